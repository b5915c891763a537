#!/bin/sh
# The project's test command (README "Test", and .ci/run). CPU only.
#   scripts/test.sh [sglang] [vllm] [e2e] [e2e-vllm] [-- extra pytest args]   (no suite named: all four)
# Builds or reuses the cached engine venvs (scripts/engine-venv.sh), then runs, per venv,
# the core tests and that engine's real-engine tests; e2e starts the real sglang server of the
# sglang venv on this CPU (tests/e2e, marker e2e; 18 server starts, ~20 min on a 2-core box);
# e2e-vllm the real vLLM OpenAI server of the vllm venv, which it never patches (tests/e2e_vllm,
# marker e2e_vllm; 10 server starts, ~14 min on a 2-core box).
# Exit status: non-zero if any test failed.
set -eu
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
suites=""
while [ $# -gt 0 ]; do
    case $1 in
        --) shift; break ;;
        *) suites="$suites $1"; shift ;;
    esac
done
if [ -z "$suites" ]; then
    suites=sglang
    [ -d tests/vllm ] && suites="$suites vllm"
    [ -d tests/e2e ] && suites="$suites e2e"
    [ -d tests/e2e_vllm ] && suites="$suites e2e-vllm"
fi

# Engines write caches under $HOME on import: keep them out of the real one (the venv cache stays put).
export SSD_STREAM_CACHE=${SSD_STREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sglang-ssd-stream}
test_home=$(mktemp -d)
trap 'rm -rf "$test_home"' EXIT
status=0
# A cold cache builds the vLLM venv (mostly download) while the sglang suite runs (mostly CPU).
vllm_build=""
case " $suites " in
    *" vllm "*)
        case " $suites " in *" sglang "*)
            scripts/engine-venv.sh vllm >"$test_home/vllm-venv.out" 2>"$test_home/vllm-venv.log" &
            vllm_build=$! ;;
        esac ;;
esac
vllm_built() {  # waits (once) for the background vLLM venv build; fails, saying why, if it failed
    [ -n "$vllm_build" ] || return 0
    pid=$vllm_build
    vllm_build=""  # a second wait on it would fail
    wait "$pid" && return 0
    cat "$test_home/vllm-venv.log" >&2
    echo "the vllm venv could not be built" >&2
    return 1
}
for suite in $suites; do
    case $suite in
        sglang)
            sg=$(scripts/engine-venv.sh sglang)
            echo "== sglang venv: $sg"
            # Every other release with a manifest gets a source-overlay venv for its RED/GREEN tests.
            pinned=$(python3 sglang_ssd_stream/patching/engines.py sglang)
            others=""
            for m in hashes/sglang-*.json; do
                r=${m#hashes/sglang-}; r=${r%.json}
                [ "$r" = "$pinned" ] && continue
                others="$others $r=$(scripts/engine-venv.sh sglang "$r")"
            done
            HOME=$test_home SSD_STREAM_SGLANG_PYTHON=$sg SSD_STREAM_SGLANG_RELEASES=$others \
                "$sg" -m pytest tests -m "not vllm and not e2e" "$@" || status=1 ;;
        vllm)
            vllm_built || { status=1; continue; }
            vl=$(scripts/engine-venv.sh vllm)
            echo "== vllm venv: $vl"
            HOME=$test_home SSD_STREAM_VLLM_PYTHON=$vl "$vl" -m pytest tests/vllm tests/test_wheel_architectures.py -m vllm "$@" || status=1 ;;
        e2e)
            sg=$(scripts/engine-venv.sh sglang)
            echo "== e2e: the real sglang server of $sg on this CPU"
            command -v cc >/dev/null || { echo "e2e needs a C compiler (cc) for the stub driver" >&2; exit 1; }
            HOME=$test_home SSD_STREAM_SGLANG_PYTHON=$sg "$sg" -m pytest tests/e2e -m e2e "$@" || status=1 ;;
        e2e-vllm)
            vllm_built || { status=1; continue; }
            vl=$(scripts/engine-venv.sh vllm)
            echo "== e2e-vllm: the real vLLM OpenAI server of $vl on this CPU"
            HOME=$test_home SSD_STREAM_VLLM_PYTHON=$vl "$vl" -m pytest tests/e2e_vllm -m e2e_vllm "$@" || status=1 ;;
        *) echo "unknown suite: $suite (expected sglang, vllm, e2e or e2e-vllm)" >&2; exit 64 ;;
    esac
done
exit $status
