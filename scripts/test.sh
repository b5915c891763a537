#!/bin/sh
# The project's test command (README "Test", and .ci/run). CPU only.
#   scripts/test.sh [--jobs N] [--durations N] [sglang] [vllm] [e2e] [e2e-vllm] [-- extra pytest args]
# (no suite named: all four). Builds or reuses the cached engine venvs (scripts/engine-venv.sh; the two
# engines' builds run side by side), gives every suite a private copy of its venv, and runs the suites two
# at a time, longest first (scripts/suites.py says why): sglang (the core tests and the real-engine
# tests of the sglang venv), vllm (the vLLM venv's), e2e (the real sglang server on this CPU; 19 server
# starts) and e2e-vllm (the real vLLM OpenAI server; 12 starts). Each suite's lines come prefixed with its
# name; a table of the stages and test counts ends the run, and --durations N adds the N slowest tests.
# Exit status: non-zero if any test failed.
set -eu
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
# Engines write caches under $HOME on import: each suite gets its own temporary HOME (the venv cache stays).
export SSD_STREAM_CACHE=${SSD_STREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sglang-ssd-stream}
# Lint first (seconds): a finding fails the run before any suite starts.
scripts/lint.sh
exec python3 scripts/suites.py "$@"
