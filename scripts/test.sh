#!/bin/sh
# The project's test command (README "Test", and .ci/run). CPU only.
#   scripts/test.sh [sglang] [vllm] [-- extra pytest args]
# Builds or reuses the cached engine venvs (scripts/engine-venv.sh), then runs, per venv,
# the core tests and that engine's real-engine tests. Exit status: non-zero if any test failed.
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
fi

# Engines write caches under $HOME on import: keep them out of the real one (the venv cache stays put).
export SSD_STREAM_CACHE=${SSD_STREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sglang-ssd-stream}
test_home=$(mktemp -d)
trap 'rm -rf "$test_home"' EXIT
status=0
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
                "$sg" -m pytest tests -m "not vllm" "$@" || status=1 ;;
        vllm)
            vl=$(scripts/engine-venv.sh vllm)
            echo "== vllm venv: $vl"
            HOME=$test_home SSD_STREAM_VLLM_PYTHON=$vl "$vl" -m pytest tests/vllm tests/test_wheel_architectures.py -m vllm "$@" || status=1 ;;
        *) echo "unknown suite: $suite (expected sglang or vllm)" >&2; exit 64 ;;
    esac
done
exit $status
