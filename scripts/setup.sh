#!/usr/bin/env bash
# Create .venv (if missing) and install neorec into it, CPU PyTorch first.
# Re-running is cheap: the install is redone only when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.neorec-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet torch==2.13.0
    .venv/bin/python -m pip install --quiet -e '.[test]'
    echo "$want" > "$stamp"
fi
