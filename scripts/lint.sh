#!/bin/sh
# Lint (ruff, pinned; pyproject.toml [tool.ruff]). Seconds: .ci/run runs it first and scripts/test.sh runs
# it before any suite, so a finding fails before the long suites start. Ruff is installed into its own
# small venv, cached beside the engine venvs.
set -eu
RUFF_VERSION=0.17.6
cd "$(dirname "$0")/.."
cache=${SSD_STREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sglang-ssd-stream}
lint=$cache/lint-ruff-$RUFF_VERSION
if [ ! -x "$lint/bin/ruff" ]; then
    rm -rf "$lint"
    python3 -m venv "$lint"
    "$lint/bin/pip" install --disable-pip-version-check -q "ruff==$RUFF_VERSION"
fi
echo "== lint: ruff $RUFF_VERSION (pyproject.toml [tool.ruff])"
exec "$lint/bin/ruff" check .
