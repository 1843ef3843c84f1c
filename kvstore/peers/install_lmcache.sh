#!/usr/bin/env bash
# Installs the LMCache 0.5.6 compatibility peer into its own venv at .peers/lmcache (CPU only),
# from its lock (locks/lmcache-peer.txt: every package pinned with its hashes; lmcache itself
# without its declared dependencies, which pull CUDA packages). Idempotent: does nothing when the
# venv was made from this lock and imports lmcache; a changed lock makes the venv again.
# Usage: bash kvstore/peers/install_lmcache.sh   (from anywhere; paths are relative to the repo root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${LMCACHE_PEER_VENV:-$ROOT/.peers/lmcache}"
PY="$VENV/bin/python"
LOCK="$ROOT/locks/lmcache-peer.txt"
STAMP="$VENV/.pdserve-lock-sha256"
want=$(sha256sum "$LOCK" | cut -d' ' -f1)

if [ -x "$PY" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] && "$PY" -c "import lmcache" >/dev/null 2>&1; then
    echo "lmcache peer already installed at $VENV"
    exit 0
fi

rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV"
# The CPU torch wheel: a local folder in pip's find-links, else PyTorch's CPU page.
"$PY" -m pip install --disable-pip-version-check --progress-bar off --no-deps --require-hashes \
    --find-links "$(python3 "$ROOT/locks/lock.py" torch-links)" -r "$LOCK"

"$PY" -c "from lmcache.utils import CacheEngineKey; from lmcache.v1.protocol import RemoteMetadata"
echo "$want" > "$STAMP"
echo "lmcache peer installed at $VENV"
