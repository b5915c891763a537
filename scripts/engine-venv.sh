#!/bin/sh
# Create (once) and print the path of a cached venv holding the pinned engine, for tests and CI.
# Usage: scripts/engine-venv.sh sglang|vllm [release]   (default: the pinned release)
# Cache key: engine, pinned release, Python minor version; an interrupted build lacks .complete
# and is rebuilt. sglang and vllm pin clashing torch versions, hence one venv each.
set -eu
engine=$1
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
pin=${2:-$("$py" "$repo/sglang_ssd_stream/patching/engines.py" "$engine")}
pyver=$("$py" -c 'import sys; print("%d%d" % sys.version_info[:2])')
cache=${SSD_STREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sglang-ssd-stream}
venv="$cache/venvs/$engine-$pin-py$pyver"

if [ ! -f "$venv/.complete" ]; then
    echo "engine-venv: building $venv (pip install $engine==$pin; ~5 min, ~10 GB)" >&2
    rm -rf "$venv"
    mkdir -p "$cache/venvs"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q "$engine==$pin" >&2
    touch "$venv/.complete"
fi
# Our own runtime and test dependencies; quick when already satisfied.
"$venv/bin/pip" install -q "filelock>=3.12" "unidiff>=0.7.5" "packaging>=23" "tqdm>=4.66" \
    "safetensors>=0.4" "pytest>=8" "hypothesis>=6.100" >&2
# The kit itself, editable, so the engine's plugin loaders see our entry points.
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$repo" >&2
echo "$venv/bin/python"
