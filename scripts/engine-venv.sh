#!/bin/sh
# Create (once) and print the path of a cached venv holding an engine release, for tests and CI.
# Usage: scripts/engine-venv.sh [--private DIR | --wheelhouse] sglang|vllm [release]   (default: the pinned
#   release)
#   --private DIR: print instead the python of a private copy made under DIR (hard links, seconds; see
#   private_copy below): what a test run patches, so two runs on one box never write the same venv.
#   --wheelhouse: print the directory of the pinned locks' wheels (downloaded once, with the venv).
# Every distribution comes from the hash locks (hashes/locks/, written by scripts/lock.py) through
# `pip install --require-hashes --no-deps`: the runtime lock install.sh uses plus the test extra.
# Cache key: engine, release, Python minor version and the SHA-256 of the locks used, so a lock
# change builds a new venv; an interrupted build lacks .complete and is rebuilt. sglang and vllm
# pin clashing torch versions, hence one venv each.
# A non-pinned release is a *source overlay*: a hardlink copy of the pinned venv with only the
# engine wheel replaced (its own overlay lock, --no-deps). Older releases' own dependency sets are
# not all installable here (sglang 0.5.22 needs cuda-tile from a vendor index), and our patches
# touch only the engine's own .py files, which the overlay carries byte for byte.
set -eu
private="" want_wheelhouse=""
case ${1:-} in
    --private) private=$2; shift 2 ;;
    --wheelhouse) want_wheelhouse=1; shift ;;
esac
engine=$1
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
pinned=$("$py" "$repo/sglang_ssd_stream/patching/engines.py" "$engine")
release=${2:-$pinned}
pyver=$("$py" -c 'import sys; print("%d%d" % sys.version_info[:2])')
arch=$(uname -m)
cache=${SSD_STREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sglang-ssd-stream}
locks=$repo/hashes/locks

lock_key() {  # first 16 hex digits of the SHA-256 over the given lock files
    cat "$@" | "$py" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])'
}

# A private copy of venv $1 at $2: hard links (the cache's inodes are shared, so only renames may write
# them: the patcher's, pip's and Python's own byte-code writes are renames), except what a test run could
# write by name: the engine package's .py sources and the kit's state directory become files of their own,
# and the entry points, whose shebangs name the cached venv's interpreter, are rewritten into new files.
# The kit is installed editable from this checkout into the copy alone, so a run never re-points the venv
# another checkout's run uses.
private_copy() {
    src=$1 dest=$2
    rm -rf "$dest"
    mkdir -p "$(dirname "$dest")"
    cp -al "$src" "$dest"
    for f in "$dest"/bin/*; do
        [ -f "$f" ] && [ ! -L "$f" ] || continue
        head -n 1 "$f" | grep -q "^#!$src/bin/" || continue
        sed "1s|^#!$src/bin/|#!$dest/bin/|" "$f" >"$f.new" && chmod 755 "$f.new" && mv "$f.new" "$f"
    done
    "$dest/bin/python" - "$dest" <<'PY'
import os, pathlib, shutil, sys
for sp in pathlib.Path(sys.argv[1]).glob("lib/python*/site-packages"):
    for top in ("sglang", "vllm", ".sglang-ssd-stream"):
        for f in (sp / top).rglob("*") if (sp / top).is_dir() else ():
            if f.is_file() and not f.is_symlink() and (top.startswith(".") or f.suffix == ".py"):
                shutil.copy2(f, f.with_name(f.name + ".private"))
                os.replace(f.with_name(f.name + ".private"), f)
PY
    "$dest/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$repo" >&2
}

runtime_lock=$locks/$engine-$pinned-py$pyver-$arch.txt
test_lock=$locks/$engine-$pinned-py$pyver-$arch.test.txt
for f in "$runtime_lock" "$test_lock"; do
    [ -f "$f" ] || { echo "engine-venv: no lock $f (scripts/lock.py writes it)" >&2; exit 2; }
done
key=$(lock_key "$runtime_lock" "$test_lock")

# One build at a time per cache: two runs building the same venv (a test run and another shell) would
# delete each other's half-built trees. The lock is held until this script exits; a second run waits,
# then finds the venv complete. One lock per engine: the two engines' venvs still build side by side. (An
# overlay build calls this script for its base: it holds the lock already.)
mkdir -p "$cache/venvs"
if [ -z "${SSD_STREAM_VENV_LOCKED:-}" ]; then
    exec 9>"$cache/venvs/.build-$engine.lock"
    flock -n 9 || { echo "engine-venv: waiting for another build of the $engine venv to finish" >&2; flock 9; }
    export SSD_STREAM_VENV_LOCKED=1
fi

wheelhouse="$cache/wheelhouse/$engine-$pinned-py$pyver-$key"
ensure_wheelhouse() {
    [ -f "$wheelhouse/.complete" ] && return 0
    rm -rf "$wheelhouse"
    mkdir -p "$wheelhouse"
    "$py" -m pip download -q --disable-pip-version-check --require-hashes --no-deps -d "$wheelhouse" \
        -r "$runtime_lock" -r "$test_lock" >&2
    touch "$wheelhouse/.complete"
}
if [ -n "$want_wheelhouse" ]; then  # the pinned locks' wheels (downloaded here if a venv predates them)
    ensure_wheelhouse
    echo "$wheelhouse"
    exit 0
fi
if [ "$release" = "$pinned" ]; then
    venv="$cache/venvs/$engine-$pinned-py$pyver-$key"
    if [ ! -f "$venv/.complete" ]; then
        echo "engine-venv: building $venv from $(basename "$runtime_lock") + $(basename "$test_lock")" \
             "(hash-checked; ~6 min, ~10 GB)" >&2
        rm -rf "$venv"
        mkdir -p "$cache/venvs"
        # The locks' wheels are downloaded once into a wheelhouse, then installed from it: the install test
        # (tests/test_install_sh.py) builds install.sh's runtime from the same wheelhouse, hash-checked by
        # install.sh's own --require-hashes, instead of downloading every wheel a second time.
        ensure_wheelhouse
        "$py" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --require-hashes --no-deps \
            --no-index --find-links "$wheelhouse" -r "$runtime_lock" -r "$test_lock" >&2
        touch "$venv/.complete"
    fi
else
    overlay_lock=$locks/$engine-$release-py$pyver-$arch.overlay.txt
    [ -f "$overlay_lock" ] || { echo "engine-venv: no lock $overlay_lock (scripts/lock.py writes it)" >&2; exit 2; }
    base=$("$0" "$engine")  # (never private: the overlay is made of the cached base)
    base_venv=$(dirname "$(dirname "$base")")
    venv="$cache/venvs/$engine-$release-on-$pinned-py$pyver-$(lock_key "$runtime_lock" "$test_lock" "$overlay_lock")"
    if [ ! -f "$venv/.complete" ]; then
        echo "engine-venv: building $venv ($engine $release sources over the $pinned venv)" >&2
        rm -rf "$venv"
        cp -al "$base_venv" "$venv"
        rm -f "$venv/.complete"
        # pip replaces files by unlink + create, so the hardlinked base venv is untouched.
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --require-hashes --no-deps \
            --force-reinstall -r "$overlay_lock" >&2
        touch "$venv/.complete"
    fi
fi
if [ -n "$private" ]; then
    copy="$private/$(basename "$venv")"
    private_copy "$venv" "$copy"
    echo "$copy/bin/python"
    exit 0
fi
# The kit itself, editable, so the engine's plugin loaders see our entry points (its dependencies
# and setuptools, the build backend, came from the lock). An overlay has its base's.
[ "$release" = "$pinned" ] && \
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$repo" >&2
echo "$venv/bin/python"
