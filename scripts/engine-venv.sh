#!/bin/sh
# Create (once) and print the path of a cached venv holding an engine release, for tests and CI.
# Usage: scripts/engine-venv.sh sglang|vllm [release]   (default: the pinned release)
# Cache key: engine, release, Python minor version; an interrupted build lacks .complete and is
# rebuilt. sglang and vllm pin clashing torch versions, hence one venv each.
# A non-pinned release is a *source overlay*: a hardlink copy of the pinned venv with only the
# engine distribution replaced (pip --no-deps). Older releases' own dependency sets are not all
# installable here (sglang 0.5.22 needs cuda-tile from a vendor index), and our patches touch
# only the engine's own .py files, which the overlay carries byte for byte.
set -eu
engine=$1
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
pinned=$("$py" "$repo/sglang_ssd_stream/patching/engines.py" "$engine")
release=${2:-$pinned}
pyver=$("$py" -c 'import sys; print("%d%d" % sys.version_info[:2])')
cache=${SSD_STREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sglang-ssd-stream}

if [ "$release" = "$pinned" ]; then
    venv="$cache/venvs/$engine-$pinned-py$pyver"
    if [ ! -f "$venv/.complete" ]; then
        echo "engine-venv: building $venv (pip install $engine==$pinned; ~5 min, ~10 GB)" >&2
        rm -rf "$venv"
        mkdir -p "$cache/venvs"
        "$py" -m venv "$venv"
        "$venv/bin/pip" install -q "$engine==$pinned" >&2
        touch "$venv/.complete"
    fi
else
    base=$("$0" "$engine")
    base_venv=$(dirname "$(dirname "$base")")
    venv="$cache/venvs/$engine-$release-on-$pinned-py$pyver"
    if [ ! -f "$venv/.complete" ]; then
        echo "engine-venv: building $venv ($engine $release sources over the $pinned venv)" >&2
        rm -rf "$venv"
        cp -al "$base_venv" "$venv"
        rm -f "$venv/.complete"
        # pip replaces files by unlink + create, so the hardlinked base venv is untouched.
        "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$engine==$release" >&2
        touch "$venv/.complete"
    fi
    echo "$venv/bin/python"
    exit 0
fi
# Our own runtime and test dependencies; quick when already satisfied.
"$venv/bin/pip" install -q "filelock>=3.12" "unidiff>=0.7.5" "packaging>=23" "tqdm>=4.66" \
    "safetensors>=0.4" "pytest>=8" "hypothesis>=6.100" >&2
# The validation suite's end-to-end test serves a tiny model with `transformers serve` (needs
# accelerate) and plots latency (matplotlib); only the sglang venv runs it.
if [ "$engine" = sglang ]; then
    "$venv/bin/pip" install -q "accelerate==1.15.0" "matplotlib==3.11.2" >&2
fi
# The kit itself, editable, so the engine's plugin loaders see our entry points.
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$repo" >&2
echo "$venv/bin/python"
