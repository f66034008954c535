#!/usr/bin/env bash
# Python packages the tests use, in a virtual environment at <repo>/.venv (git-ignored):
#   openai  the official client, driven against `baton serve` by crates/baton-server/tests/openai.rs
# Idempotent: nothing is installed when the pinned version is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
readonly OPENAI_VERSION="3.54.0"
PYTHON=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
    echo "install-python-deps: creating .venv"
    "$PYTHON" -m venv .venv
fi
if .venv/bin/python -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
    echo "install-python-deps: openai $OPENAI_VERSION already installed"
else
    echo "install-python-deps: pip install openai==$OPENAI_VERSION"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION"
fi
