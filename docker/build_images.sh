#!/usr/bin/env bash
# Builds the images compose.yaml runs: pdserve/pdserve:latest (kvstore, workers, router) and
# pdserve/redis:latest. Works on machines that reach Debian's archive and PyPI but no image
# registry:
#   - base image: $PDSERVE_BASE_IMAGE when set; else python:3.11-slim when present or pullable;
#     else (or with PDSERVE_BUILD_BASE=1) a Debian bookworm rootfs made with debootstrap and
#     imported as pdserve/base:bookworm (reused on later runs);
#   - torch: when pip's find-links (PIP_FIND_LINKS or pip config) names a local folder holding
#     the lock's torch CPU wheel (locks/lock.py torch-links), that folder is served on 127.0.0.1
#     during the build, which runs with --network host, so pip installs that wheel instead of
#     downloading one;
#   - TLS: the *.crt files of the local CA folder (/usr/local/share/ca-certificates) are copied
#     into docker/certs/ (gitignored) and trusted inside the image.
# Environment: PDSERVE_IMAGE, PDSERVE_REDIS_IMAGE (tags), PDSERVE_BASE_IMAGE, PDSERVE_BUILD_BASE,
# LOCAL_CA_DIR, DOCKER_BUILD_EXTRA (extra `docker build` arguments, e.g. --no-cache),
# PDSERVE_BUILD_CACHE_KEEP (build cache kept after pruning, default 6GB).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${PDSERVE_IMAGE:-pdserve/pdserve:latest}
REDIS_IMAGE=${PDSERVE_REDIS_IMAGE:-pdserve/redis:latest}
LOCAL_BASE=pdserve/base:bookworm
REGISTRY_BASE=python:3.11-slim
LOCAL_CA_DIR=${LOCAL_CA_DIR:-/usr/local/share/ca-certificates}

say() { echo "[build_images] $*" >&2; }
die() { echo "[build_images] ERROR: $*" >&2; exit 1; }
now() { date +%s; }
command -v docker >/dev/null 2>&1 || die "docker not found: run docker/install_docker.sh first"
docker info >/dev/null 2>&1 || die "the docker engine does not answer: run docker/install_docker.sh first"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

debian_url() {  # $1 = "main" or "security": the mirror apt already uses for it
  local url=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    url=$(awk -v want="$1" '/^URIs:/ { sec = ($2 ~ /security/); if ((want == "security") == sec) { print $2; exit } }' \
          /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$url" ] && [ -f /etc/apt/sources.list ]; then
    url=$(awk -v want="$1" '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {
            sec = ($i ~ /security/); if ((want == "security") == sec) { print $i; exit } } }' /etc/apt/sources.list)
  fi
  if [ -z "$url" ]; then
    if [ "$1" = security ]; then url=http://deb.debian.org/debian-security; else url=http://deb.debian.org/debian; fi
  fi
  echo "$url"
}

build_debootstrap_base() {
  command -v debootstrap >/dev/null 2>&1 || die "debootstrap not found: run docker/install_docker.sh first"
  local mirror security rootfs t0
  mirror=$(debian_url main)
  security=$(debian_url security)
  rootfs=$(mktemp -d /tmp/pdserve-rootfs.XXXXXX)
  t0=$(now)
  say "debootstrap --variant=minbase bookworm from $mirror into $rootfs"
  $SUDO debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/tmp/pdserve-debootstrap.log 2>&1 \
    || { tail -n 20 /tmp/pdserve-debootstrap.log >&2; $SUDO rm -rf "$rootfs"; die "debootstrap failed"; }
  $SUDO chroot "$rootfs" apt-get clean
  $SUDO rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/tmp/*
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s bookworm-security main\n' \
    "$mirror" "$mirror" "$security" | $SUDO tee "$rootfs/etc/apt/sources.list" >/dev/null
  say "importing $rootfs as $LOCAL_BASE"
  $SUDO tar -C "$rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' - "$LOCAL_BASE" >/dev/null \
    || { $SUDO rm -rf "$rootfs"; die "docker import failed"; }
  $SUDO rm -rf "$rootfs"
  say "base image $LOCAL_BASE built in $(( $(now) - t0 )) s"
}

# --- 1. the base image ------------------------------------------------------------------------
if [ -n "${PDSERVE_BASE_IMAGE:-}" ]; then
  BASE=$PDSERVE_BASE_IMAGE
  say "base image (PDSERVE_BASE_IMAGE): $BASE"
elif [ "${PDSERVE_BUILD_BASE:-0}" = 1 ]; then
  build_debootstrap_base
  BASE=$LOCAL_BASE
elif docker image inspect "$REGISTRY_BASE" >/dev/null 2>&1; then
  BASE=$REGISTRY_BASE
  say "base image: $BASE (present)"
elif docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
  BASE=$LOCAL_BASE
  say "base image: $BASE (built earlier with debootstrap; PDSERVE_BUILD_BASE=1 rebuilds it)"
elif timeout 60 docker pull -q "$REGISTRY_BASE" >/dev/null 2>&1; then
  BASE=$REGISTRY_BASE
  say "base image: $BASE (pulled)"
else
  say "no image registry reachable ($REGISTRY_BASE cannot be pulled): building a Debian base locally"
  build_debootstrap_base
  BASE=$LOCAL_BASE
fi

# --- 2. CA certificates -----------------------------------------------------------------------
find docker/certs -maxdepth 1 -name '*.crt' -delete
if ls "$LOCAL_CA_DIR"/*.crt >/dev/null 2>&1; then
  cp "$LOCAL_CA_DIR"/*.crt docker/certs/
  say "CA certificates trusted in the image: $(cd docker/certs && ls ./*.crt | tr '\n' ' ')"
else
  say "no CA certificates in $LOCAL_CA_DIR: the image trusts the public roots only"
fi

# --- 3. the local torch wheel, served on loopback ---------------------------------------------
# the folder (or PyTorch's page) where pip finds the lock's torch CPU wheel
TORCH_LINKS=$(python3 locks/lock.py torch-links)
WHEEL_DIR=""
[ -d "$TORCH_LINKS" ] && WHEEL_DIR=$TORCH_LINKS

TORCH_ARGS=()
SERVER_PID=""
cleanup() { if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi; }
trap cleanup EXIT
if [ -n "$WHEEL_DIR" ]; then
  PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python3 -m http.server --bind 127.0.0.1 "$PORT" -d "$WHEEL_DIR" >/tmp/pdserve-wheel-server.log 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 50); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/', timeout=1)" 2>/dev/null && break
    sleep 0.2
  done
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/', timeout=1)" \
    || die "the wheel server on 127.0.0.1:$PORT did not start (log: /tmp/pdserve-wheel-server.log)"
  TORCH_ARGS=(--build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$PORT/")
  say "serving the torch CPU wheel from $WHEEL_DIR on 127.0.0.1:$PORT (pid $SERVER_PID) for the build"
else
  say "no local torch wheel in pip's find-links: the build gets torch from $TORCH_LINKS"
fi

# --- 4. the images ----------------------------------------------------------------------------
build() {  # $1 = tag, $2 = Dockerfile, rest = extra arguments
  local tag=$1 file=$2 t0
  shift 2
  t0=$(now)
  say "docker build -t $tag -f $file (base $BASE)"
  # shellcheck disable=SC2086
  docker build --network host --build-arg "BASE_IMAGE=$BASE" "$@" ${DOCKER_BUILD_EXTRA:-} \
    -t "$tag" -f "$file" . || die "building $tag failed"
  say "built $tag in $(( $(now) - t0 )) s: $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}')"
}
# Every rebuild after a source change leaves the previous image untagged and its layers in the
# build cache (~3 GB each): on a machine that builds again and again (CI) that filled the disk.
# Untagged images go, and the build cache keeps only its most recently used $KEEP_CACHE.
KEEP_CACHE=${PDSERVE_BUILD_CACHE_KEEP:-6GB}
tidy() {
  docker image prune -f >/dev/null || say "warning: docker image prune failed"
  docker builder prune -f --keep-storage "$KEEP_CACHE" >/dev/null || say "warning: docker builder prune failed"
}
free_gb() { df -P --block-size=1G "$(docker info -f '{{.DockerRootDir}}' 2>/dev/null || echo /)" | awk 'NR == 2 { print $4 }'; }
tidy
say "free disk for docker: $(free_gb) GB (an image build needs ~8 GB)"
[ "$(free_gb)" -ge 8 ] || say "warning: under 8 GB free: the build may fail with 'No space left on device'"
build "$REDIS_IMAGE" docker/redis.Dockerfile
build "$IMAGE" docker/Dockerfile "${TORCH_ARGS[@]}"
tidy
say "done: $IMAGE and $REDIS_IMAGE ($(free_gb) GB free)"
