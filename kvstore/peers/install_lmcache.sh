#!/usr/bin/env bash
# Installs the LMCache 0.5.6 compatibility peer into its own venv at .peers/lmcache (CPU only).
# Recipe: shared/docs/peers.md. Idempotent: does nothing when the venv already imports lmcache.
# Usage: bash kvstore/peers/install_lmcache.sh   (from anywhere; paths are relative to the repo root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${LMCACHE_PEER_VENV:-$ROOT/.peers/lmcache}"
PY="$VENV/bin/python"

if [ -x "$PY" ] && "$PY" -c "import lmcache" >/dev/null 2>&1; then
    echo "lmcache peer already installed at $VENV"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV"
PIP=("$PY" -m pip install --disable-pip-version-check --progress-bar off)

# The CPU torch wheel comes from the local wheel folder (pip's find-links); install it first so
# nothing below pulls a CUDA build.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" --no-deps "lmcache==0.5.6"
"${PIP[@]}" numba cachetools sortedcontainers prometheus_client psutil py-cpuinfo numpy \
    aiohttp requests pyyaml redis transformers msgspec pyzmq cryptography aiofile aiofiles

"$PY" -c "from lmcache.utils import CacheEngineKey; from lmcache.v1.protocol import RemoteMetadata"
echo "lmcache peer installed at $VENV"
