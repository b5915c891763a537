#!/bin/sh
# Build an isolated runtime for Qwen3.8 Flash-Next: a venv with the pinned engine and this kit,
# the kit's source patches applied and verified, and the CLI linked into ~/.local/bin.
# Every wheel is hash-checked: pip install --require-hashes --no-deps -r hashes/locks/<engine>-<release>-
# py<XY>-<arch>.txt (the engine, its whole dependency set, the kit's dependencies and build backend).
# Re-running on an installed runtime is a verified no-op. No sudo; nothing is piped into a shell.
set -eu

usage() {
    cat <<'USAGE'
usage: ./install.sh [--engine sglang|vllm] [--prefix DIR] [--bin-dir DIR] [--python PY]
                    [--lock FILE | --unlocked] [--dry-run | --check [--deep]]

  --engine    engine to install (default: sglang)
  --prefix    runtime root (default: ${XDG_DATA_HOME:-$HOME/.local/share}/sglang-ssd-stream)
  --bin-dir   where the CLI links go (default: $HOME/.local/bin)
  --python    interpreter for the venv (default: python3; CPython 3.11-3.13)
  --lock      install from this lock instead of hashes/locks/<engine>-<release>-py<XY>-<arch>.txt
              (every line must still carry its SHA-256; pip refuses anything else)
  --unlocked  install WITHOUT hash checking (pip resolves <engine>==<release> and its dependencies
              from the index as they are today); source files are still hash-checked by patch apply
  --dry-run   print what would be done, change nothing
  --check     exit 0 only if the runtime is installed, current and verified (the files the patches
              touch, by SHA-256); change nothing
  --deep      with --check: also hash every file the engine's RECORD lists against it (slow)

Two installs into one --prefix run one at a time: the second waits for the first, saying so.

exit codes: 0 ok, 1 --check found a problem, 2 refused (unsupported platform, no lock, a wheel whose
hash does not match the lock, unknown source state), 4 pip failed for another reason (network, disk),
64 usage, 129/130/143 interrupted by SIGHUP/SIGINT/SIGTERM (its children stopped, a runtime or venv
this run began removed)
USAGE
}

engine=sglang
prefix=${XDG_DATA_HOME:-$HOME/.local/share}/sglang-ssd-stream
bin_dir=$HOME/.local/bin
python=python3
mode=install
lock=
unlocked=0
deep=0
while [ $# -gt 0 ]; do
    case $1 in
        --engine) [ $# -ge 2 ] || { usage >&2; exit 64; }; engine=$2; shift 2 ;;
        --prefix) [ $# -ge 2 ] || { usage >&2; exit 64; }; prefix=$2; shift 2 ;;
        --bin-dir) [ $# -ge 2 ] || { usage >&2; exit 64; }; bin_dir=$2; shift 2 ;;
        --python) [ $# -ge 2 ] || { usage >&2; exit 64; }; python=$2; shift 2 ;;
        --lock) [ $# -ge 2 ] || { usage >&2; exit 64; }; lock=$2; shift 2 ;;
        --unlocked) unlocked=1; shift ;;
        --dry-run) mode=dry-run; shift ;;
        --check) mode=check; shift ;;
        --deep) deep=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option $1" >&2; usage >&2; exit 64 ;;
    esac
done

[ -z "$lock" ] || [ $unlocked -eq 0 ] || { echo "install.sh: --lock and --unlocked exclude each other" >&2; exit 64; }
[ $deep -eq 0 ] || [ "$mode" = check ] || { echo "install.sh: --deep goes with --check" >&2; exit 64; }

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
    || refuse "'$python' does not run as a Python interpreter"
case $pyver in
    3.11|3.12|3.13) ;;
    "") refuse "'$python' printed no Python version: it is not a Python interpreter (use --python)" ;;
    *) refuse "Python $pyver is unsupported; the $engine wheels need CPython 3.11-3.13 (use --python)" ;;
esac

repo=$(cd "$(dirname "$0")" && pwd)
pin=$("$python" "$repo/sglang_ssd_stream/patching/engines.py" "$engine")
runtime=$prefix/$engine-$pin
venv=$runtime/venv
vpy=$venv/bin/python
# Fingerprint of the kit as shipped (code, patches, manifests, locks): a change means reinstalling it.
kit_sha=$(cd "$repo" && find pyproject.toml sglang_ssd_stream vllm_ple_offload patches hashes \
    -name __pycache__ -prune -o -type f -print | LC_ALL=C sort | xargs cat | "$python" -c \
    'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
sha_of() { "$python" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$1"; }

# --- which wheels: the lock for this engine release, Python and architecture (or --unlocked)
pytag=$(printf '%s' "$pyver" | tr -d .)
if [ $unlocked -eq 1 ]; then
    engine_id=unlocked
    {
        echo "install.sh: WARNING: --unlocked: installing $engine==$pin, its dependencies and the kit's"
        echo "install.sh: WARNING: WITHOUT hash checking. pip takes whatever the index serves today: the wheels"
        echo "install.sh: WARNING: are not compared with hashes/locks/, so a changed, substituted or tampered"
        echo "install.sh: WARNING: wheel is installed as is. Engine source files are still hash-checked by"
        echo "install.sh: WARNING: patch apply. Use it only where no lock exists for this platform."
    } >&2
else
    lock=${lock:-$repo/hashes/locks/$engine-$pin-py$pytag-$arch.txt}
    [ -f "$lock" ] || refuse "no lock $lock for $engine $pin on CPython $pyver $arch; scripts/lock.py writes one (or use --unlocked to install without hash checking)"
    engine_id=$(sha_of "$lock")
fi

installed_from() { cat "$venv/.engine-$engine-$pin" 2>/dev/null || true; }
# A venv is current when it was installed from this very lock (its SHA-256 is recorded); --unlocked
# accepts whatever venv is there.
engine_ok() {
    [ -x "$vpy" ] && [ -n "$(installed_from)" ] && { [ "$engine_id" = unlocked ] || [ "$(installed_from)" = "$engine_id" ]; }
}
kit_ok() { [ "$(cat "$runtime/kit.sha256" 2>/dev/null || true)" = "$kit_sha" ]; }
link_ok() { [ "$(readlink "$bin_dir/$cli" 2>/dev/null || true)" = "$venv/bin/$cli" ]; }

if [ "$mode" = check ]; then
    problems=0
    if [ -f "$prefix/.install.lock" ] && ! "$python" -c 'import fcntl, sys
with open(sys.argv[1]) as f:
    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)' "$prefix/.install.lock" 2>/dev/null; then
        say "an install.sh is installing into $prefix right now: what follows may change when it finishes"
    fi
    if ! engine_ok; then
        if [ -f "$venv/.engine-$engine-$pin" ]; then
            say "the $engine $pin venv at $venv was installed from another lock (or --unlocked) than $engine_id"
        elif [ -d "$venv" ]; then
            say "the $engine $pin venv at $venv is INCOMPLETE (an install was interrupted or failed): run install.sh again"
        else
            say "no $engine $pin venv at $venv"
        fi
        problems=1
    fi
    kit_ok || { say "the kit in $runtime is missing or older than $repo"; problems=1; }
    if [ "$(installed_from)" = unlocked ]; then
        say "note: the $engine venv was installed --unlocked: its wheels were never hash-checked"
    fi
    if engine_ok; then
        if [ $deep -eq 1 ]; then
            "$venv/bin/$cli" patch verify --deep --python "$vpy" || problems=1
        else
            "$venv/bin/$cli" patch verify --python "$vpy" || problems=1
        fi
    fi
    link_ok || { say "$bin_dir/$cli does not point to $venv/bin/$cli"; problems=1; }
    [ $problems -eq 0 ] && say "runtime $runtime is installed, current and verified"
    exit $problems
fi

# One install at a time per prefix: a second run would remove the venv the first one's pip is writing. The lock
# is flock(2) on $prefix/.install.lock, taken by Python on this shell's descriptor 9 (no util-linux needed): it
# belongs to the open file, so it holds until this script and every child it started (pip) have exited.
if [ "$mode" = install ]; then
    mkdir -p "$prefix" 2>/dev/null && [ -w "$prefix" ] \
        || refuse "cannot write to $prefix (a read-only or foreign directory?): choose a writable place with --prefix DIR, and --bin-dir DIR for the CLI link"
    exec 9>>"$prefix/.install.lock"
    "$python" - "$prefix" <<'PY' || exit $?
import fcntl, os, sys, time
parent = os.getppid()
try:
    fcntl.flock(9, fcntl.LOCK_EX | fcntl.LOCK_NB)
    sys.exit(0)
except BlockingIOError:
    pass
print(f"install.sh: another install.sh is installing into {sys.argv[1]}: waiting for it to finish (its files are "
      f"left alone; Ctrl-C stops waiting)", flush=True)
t0, report = time.monotonic(), 30
try:
    while True:
        time.sleep(1)
        if os.getppid() != parent:  # install.sh is gone: stop waiting for it
            sys.exit(1)
        try:
            fcntl.flock(9, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() - t0 >= report:
                print(f"install.sh: still waiting for the other install.sh ({report // 60} min {report % 60} s)",
                      flush=True)
                report += 30
except KeyboardInterrupt:
    print("install.sh: stopped waiting (SIGINT); nothing was changed", file=sys.stderr)
    sys.exit(130)
print("install.sh: the other install.sh has finished; going on", flush=True)
PY
fi

run() {
    if [ "$mode" = dry-run ]; then
        if [ "$1" = pip_install ]; then
            shift
            say "would run: $vpy -m pip install $*"
        else
            say "would run: $*"
        fi
    else
        "$@"
    fi
}

say "runtime: $runtime ($engine $pin, Python $pyver, $arch)"
# A signal stops pip and what it started, removes the runtime (or venv) this run began, and exits
# 128 + signal. pip runs in the background: sh runs a trap only once the foreground child ends.
pip_pid=
pip_starting=0
pid_before=
created_runtime=0
created_venv=0
remove_partial() {  # $1: why; what this run created and has not completed
    if [ "$created_runtime" = 1 ]; then
        rm -rf "$runtime"
        printf 'install.sh: %s. Removed %s; nothing was installed.\n' "$1" "$runtime" >&2
    elif [ "$created_venv" = 1 ]; then
        rm -rf "$venv"
        printf 'install.sh: %s. Removed %s; nothing was installed.\n' "$1" "$venv" >&2
    else
        printf 'install.sh: %s. The runtime %s is as it was.\n' "$1" "$runtime" >&2
    fi
}
on_signal() {  # $1: signal name, $2: exit code
    trap '' HUP INT TERM
    if [ "$created_runtime" = 1 ] || [ "$created_venv" = 1 ]; then
        printf 'install.sh: SIG%s: stopping pip and removing what this run began (a large venv takes a while)...\n' "$1" >&2
    fi
    # between pip's fork and `pip_pid=$!` the pid is only in $! (a new one: not the last pip's)
    if [ -z "$pip_pid" ] && [ "$pip_starting" = 1 ] && [ "${!:-}" != "$pid_before" ]; then
        pip_pid=${!:-}
    fi
    if [ -n "$pip_pid" ]; then
        pkill -TERM -P "$pip_pid" 2>/dev/null || true
        kill -TERM "$pip_pid" 2>/dev/null || true
        wait "$pip_pid" 2>/dev/null || true
    fi
    remove_partial "interrupted by SIG$1"
    exit "$2"
}
trap 'on_signal HUP 129' HUP
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM
pip_install() {  # pip_install ARGS...: hash-checked unless --unlocked; a failure removes what this run made
    log=$(mktemp)
    pid_before=${!:-}
    pip_starting=1
    "$vpy" -m pip install --disable-pip-version-check --progress-bar off "$@" >"$log" 2>&1 &
    pip_pid=$!
    pip_starting=0
    pip_rc=0
    # pip -q is silent for minutes: say every 30 s that it works and how far the venv has grown. Sleeping
    # 1 s at a time keeps a signal's trap within a second.
    pip_started=$(date +%s)
    pip_next=30
    while kill -0 "$pip_pid" 2>/dev/null; do
        sleep 1
        pip_now=$(( $(date +%s) - pip_started ))
        if [ "$pip_now" -ge "$pip_next" ]; then
            # pip's last line says what it is on (Collecting / Downloading NAME (SIZE) / Installing ...)
            pip_doing=$(grep -v '^ *$' "$log" 2>/dev/null | tail -n 1 | cut -c1-160)
            say "pip is still installing ($((pip_now / 60)) min $((pip_now % 60)) s; $(du -sm "$venv" 2>/dev/null | cut -f1) MB in $venv so far)${pip_doing:+; pip: $pip_doing}"
            pip_next=$((pip_next + 30))
        fi
    done
    wait "$pip_pid" || pip_rc=$?
    pip_pid=
    if [ $pip_rc -eq 0 ]; then
        rm -f "$log"
        return 0
    fi
    cat "$log" >&2
    if grep -q "DO NOT MATCH THE HASHES\|Hashes are required\|hash mismatch" "$log"; then
        why="a distribution does not match its SHA-256 in $lock (pip's report above); refusing to install it"
        code=2
    else
        why="pip could not install from ${lock:-the index} (its output above)"
        code=4
    fi
    rm -f "$log"
    remove_partial "$why"
    exit $code
}
created_runtime=0
created_venv=0
[ -d "$runtime" ] || created_runtime=1
if engine_ok; then
    if [ "$(installed_from)" = unlocked ]; then
        say "$engine $pin venv: present (installed --unlocked: its wheels were never hash-checked)"
    else
        say "$engine $pin venv: present (installed from the lock with SHA-256 $(installed_from))"
    fi
else
    if [ $unlocked -eq 1 ]; then
        say "$engine $pin venv: creating WITHOUT hash checking (~11 GB on disk; 5-15 minutes, a progress line every 30 s)"
    else
        say "$engine $pin venv: creating from $lock, every wheel hash-checked (~11 GB on disk; 5-15 minutes, a progress line every 30 s)"
    fi
    created_venv=1
    run rm -rf "$venv"
    if [ "$mode" = install ]; then
        mkdir -p "$runtime" 2>/dev/null \
            || refuse "cannot create $runtime: choose a writable place with --prefix DIR, and --bin-dir DIR for the CLI link"
    else
        say "would run: mkdir -p $runtime"
    fi
    run "$python" -m venv "$venv"
    if [ $unlocked -eq 1 ]; then
        run pip_install "$engine==$pin"
    else
        run pip_install --require-hashes --no-deps -r "$lock"
    fi
    if [ "$mode" = install ]; then
        printf '%s\n' "$engine_id" > "$venv/.engine-$engine-$pin"
        created_runtime=0  # the venv is complete: an interruption from here on keeps it
        created_venv=0
    fi
fi
if kit_ok; then
    say "kit: current"
else
    say "kit: installing from $repo"
    if [ $unlocked -eq 1 ]; then
        run pip_install "$repo"
    else
        # Its dependencies and setuptools (the build backend) came from the lock: nothing unhashed is fetched.
        run pip_install --no-deps --no-build-isolation "$repo"
    fi
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
    { mkdir -p "$bin_dir" 2>/dev/null && [ -w "$bin_dir" ]; } \
        || refuse "the runtime $runtime is installed and verified, but $bin_dir is not writable for the CLI link: run again with --bin-dir DIR (a directory on your PATH), or use $venv/bin/$cli"
    tmp_link="$bin_dir/.$cli.tmp.$$"
    ln -s "$venv/bin/$cli" "$tmp_link"
    mv -f "$tmp_link" "$bin_dir/$cli"  # rename(2): the old link is replaced atomically
fi
say "linked $bin_dir/$cli -> $venv/bin/$cli"
case ":$PATH:" in
    *":$bin_dir:"*) ;;
    *) say "$bin_dir is not on your PATH: add it (e.g. in ~/.profile): export PATH=\"$bin_dir:\$PATH\"" ;;
esac
if [ "$engine" = sglang ]; then
    say "serve with: $cli serve --profile <profile> --model <dir> (or $venv/bin/sglang serve --model-path <model> ... with SGLANG_PLUGINS=ssd_stream)"
    say "the vLLM side (vllm-ple-offload) is a separate runtime: ./install.sh --engine vllm"
else
    say "serve with: $cli serve --profile <profile> --model <dir> (or $venv/bin/vllm serve <model> ...)"
fi
