#!/bin/sh
# Build an isolated runtime for Qwen3.8 Flash-Next: a venv with the pinned engine and this kit,
# the kit's source patches applied and verified, and the CLI linked into ~/.local/bin.
# Re-running on an installed runtime is a verified no-op. No sudo; nothing is piped into a shell.
set -eu

usage() {
    cat <<'USAGE'
usage: ./install.sh [--engine sglang|vllm] [--prefix DIR] [--bin-dir DIR] [--python PY] [--dry-run | --check]

  --engine    engine to install (default: sglang)
  --prefix    runtime root (default: ${XDG_DATA_HOME:-$HOME/.local/share}/sglang-ssd-stream)
  --bin-dir   where the CLI links go (default: $HOME/.local/bin)
  --python    interpreter for the venv (default: python3; CPython 3.11-3.13)
  --dry-run   print what would be done, change nothing
  --check     exit 0 only if the runtime is installed, current and verified; change nothing

exit codes: 0 ok, 1 --check found a problem, 2 refused (unsupported platform, unknown source state), 64 usage
USAGE
}

engine=sglang
prefix=${XDG_DATA_HOME:-$HOME/.local/share}/sglang-ssd-stream
bin_dir=$HOME/.local/bin
python=python3
mode=install
while [ $# -gt 0 ]; do
    case $1 in
        --engine) [ $# -ge 2 ] || { usage >&2; exit 64; }; engine=$2; shift 2 ;;
        --prefix) [ $# -ge 2 ] || { usage >&2; exit 64; }; prefix=$2; shift 2 ;;
        --bin-dir) [ $# -ge 2 ] || { usage >&2; exit 64; }; bin_dir=$2; shift 2 ;;
        --python) [ $# -ge 2 ] || { usage >&2; exit 64; }; python=$2; shift 2 ;;
        --dry-run) mode=dry-run; shift ;;
        --check) mode=check; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option $1" >&2; usage >&2; exit 64 ;;
    esac
done

say() { printf 'install.sh: %s\n' "$*"; }
refuse() { printf 'install.sh: refusing: %s\n' "$*" >&2; exit 2; }

case $engine in
    sglang) cli=sglang-ssd-stream ;;
    vllm) cli=vllm-ple-offload ;;
    *) echo "install.sh: --engine must be sglang or vllm, not '$engine'" >&2; exit 64 ;;
esac

# --- platform: the engines publish Linux wheels for x86_64 and aarch64 (Jetson Thor) only
os=$(uname -s)
arch=$(uname -m)
[ "$os" = Linux ] || refuse "unsupported OS '$os'; $engine wheels exist for Linux only"
case $arch in
    x86_64|aarch64) ;;
    *) refuse "unsupported architecture '$arch'; $engine wheels exist for x86_64 and aarch64" ;;
esac
command -v "$python" >/dev/null 2>&1 || refuse "no Python interpreter '$python' (use --python)"
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
    || refuse "'$python' does not run"
case $pyver in
    3.11|3.12|3.13) ;;
    *) refuse "Python $pyver is unsupported; $engine $engine wheels need CPython 3.11-3.13 (use --python)" ;;
esac

repo=$(cd "$(dirname "$0")" && pwd)
pin=$("$python" "$repo/sglang_ssd_stream/patching/engines.py" "$engine")
runtime=$prefix/$engine-$pin
venv=$runtime/venv
vpy=$venv/bin/python
# Fingerprint of the kit as shipped (code, patches, manifests): a change means reinstalling it.
kit_sha=$(cd "$repo" && find pyproject.toml sglang_ssd_stream vllm_ple_offload patches hashes \
    -name __pycache__ -prune -o -type f -print | LC_ALL=C sort | xargs cat | "$python" -c \
    'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')

engine_ok() { [ -f "$venv/.engine-$engine-$pin" ] && [ -x "$vpy" ]; }
kit_ok() { [ "$(cat "$runtime/kit.sha256" 2>/dev/null || true)" = "$kit_sha" ]; }
link_ok() { [ "$(readlink "$bin_dir/$cli" 2>/dev/null || true)" = "$venv/bin/$cli" ]; }

if [ "$mode" = check ]; then
    problems=0
    engine_ok || { say "no $engine $pin venv at $venv"; problems=1; }
    kit_ok || { say "the kit in $runtime is missing or older than $repo"; problems=1; }
    if engine_ok; then
        "$venv/bin/$cli" patch verify --python "$vpy" || problems=1
    fi
    link_ok || { say "$bin_dir/$cli does not point to $venv/bin/$cli"; problems=1; }
    [ $problems -eq 0 ] && say "runtime $runtime is installed, current and verified"
    exit $problems
fi

run() {
    if [ "$mode" = dry-run ]; then
        say "would run: $*"
    else
        "$@"
    fi
}

say "runtime: $runtime ($engine $pin, Python $pyver, $arch)"
if engine_ok; then
    say "$engine $pin venv: present"
else
    say "$engine $pin venv: creating (downloads ~2-3 GB; about 5 minutes)"
    run rm -rf "$venv"
    run mkdir -p "$runtime"
    run "$python" -m venv "$venv"
    run "$vpy" -m pip install --disable-pip-version-check -q "$engine==$pin"
    run touch "$venv/.engine-$engine-$pin"
fi
if kit_ok; then
    say "kit: current"
else
    say "kit: installing from $repo"
    run "$vpy" -m pip install --disable-pip-version-check -q "$repo"
    if [ "$mode" = install ]; then
        printf '%s\n' "$kit_sha" > "$runtime/kit.sha256.tmp"
        mv -f "$runtime/kit.sha256.tmp" "$runtime/kit.sha256"
    fi
fi

if [ "$mode" = dry-run ]; then
    if engine_ok; then
        "$venv/bin/$cli" patch apply --dry-run --python "$vpy" || exit $?
    else
        say "would run: $cli patch apply --python $vpy"
    fi
    link_ok || say "would link $bin_dir/$cli -> $venv/bin/$cli"
    exit 0
fi

# apply refuses (exit 2-5) on any source state it does not know, and changes nothing then.
"$venv/bin/$cli" patch apply --python "$vpy"
"$venv/bin/$cli" patch verify --python "$vpy"

if ! link_ok; then
    mkdir -p "$bin_dir"
    tmp_link="$bin_dir/.$cli.tmp.$$"
    ln -s "$venv/bin/$cli" "$tmp_link"
    mv -f "$tmp_link" "$bin_dir/$cli"  # rename(2): the old link is replaced atomically
fi
say "linked $bin_dir/$cli -> $venv/bin/$cli"
if [ "$engine" = sglang ]; then
    say "serve with: $vpy -m sglang.launch_server --model-path <model> ... (SGLANG_PLUGINS=ssd_stream)"
else
    say "serve with: $venv/bin/vllm serve <model> ..."
fi
