#!/usr/bin/env bash
# Installs and starts a Docker engine with the compose v2 and buildx plugins, for `make test-compose`.
# Idempotent: every step is skipped when its result is already there.
#   1. docker.io + debootstrap from Debian (apt) when dockerd / debootstrap are missing;
#   2. dockerd started in the background (log: $DOCKERD_LOG) unless `docker info` already answers;
#   3. `docker compose` v2 + `docker buildx`: when missing, Debian trixie's docker-compose and
#      docker-buildx packages (they run on bookworm: libc >= 2.34 only), fetched with
#      `apt-get download` through a throw-away apt configuration, unpacked with dpkg-deb and linked
#      into $DOCKER_CONFIG/cli-plugins (when DOCKER_CONFIG is set) or /usr/local/lib/docker/cli-plugins.
set -euo pipefail

DOCKERD_LOG=${DOCKERD_LOG:-/var/log/pdserve-dockerd.log}
PLUGIN_STORE=${PLUGIN_STORE:-/opt/pdserve-docker-plugins}
if [ -n "${DOCKER_CONFIG:-}" ]; then PLUGIN_DIR="$DOCKER_CONFIG/cli-plugins"
else PLUGIN_DIR=/usr/local/lib/docker/cli-plugins; fi

say() { echo "[install_docker] $*" >&2; }
die() { echo "[install_docker] ERROR: $*" >&2; exit 1; }
SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || die "not root and no sudo: cannot install packages or start dockerd"
  SUDO=sudo
fi

# The Debian mirror apt already uses (deb822 .sources or a classic sources.list).
debian_mirror() {
  local url=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    url=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$url" ] && [ -f /etc/apt/sources.list ]; then
    url=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' \
          /etc/apt/sources.list)
  fi
  echo "${url:-http://deb.debian.org/debian}"
}

# --- 1. packages ------------------------------------------------------------------------------
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v docker >/dev/null 2>&1 || missing+=(docker.io)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing from Debian: ${missing[*]}"
  $SUDO apt-get update -q || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" \
    iptables ca-certificates || die "apt-get install ${missing[*]} failed"
else
  say "dockerd and debootstrap already installed"
fi

# --- 2. the engine ----------------------------------------------------------------------------
if docker info >/dev/null 2>&1; then
  say "docker engine already running ($(docker info --format '{{.ServerVersion}}' 2>/dev/null))"
else
  say "starting dockerd in the background (log: $DOCKERD_LOG)"
  # setsid: dockerd outlives this script and the make / CI step that ran it.
  $SUDO setsid nohup dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  docker info >/dev/null 2>&1 || { tail -n 30 "$DOCKERD_LOG" >&2 || true; die "dockerd did not answer within 60 s"; }
  say "docker engine up ($(docker info --format '{{.ServerVersion}}'))"
fi

# --- 3. compose v2 + buildx plugins -----------------------------------------------------------
compose_v2() { docker compose version 2>/dev/null | grep -qE 'v?2\.'; }
have_buildx() { docker buildx version >/dev/null 2>&1; }
if compose_v2 && have_buildx; then
  say "plugins present: $(docker compose version | head -n1); $(docker buildx version | head -n1)"
  exit 0
fi

if [ ! -x "$PLUGIN_STORE/usr/libexec/docker/cli-plugins/docker-compose" ] \
   || [ ! -x "$PLUGIN_STORE/usr/libexec/docker/cli-plugins/docker-buildx" ]; then
  mirror=$(debian_mirror)
  say "fetching docker-compose + docker-buildx from Debian trixie ($mirror)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/debs"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" >"$tmp/sources.list"
  apt_opts=(-o "Dir::Etc::sourcelist=$tmp/sources.list" -o "Dir::Etc::sourceparts=-"
            -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache"
            -o "APT::Get::List-Cleanup=0" -o "APT::Sandbox::User=root")
  apt-get "${apt_opts[@]}" update -q || die "apt-get update (trixie) failed"
  (cd "$tmp/debs" && apt-get "${apt_opts[@]}" download docker-compose docker-buildx) \
    || die "apt-get download docker-compose docker-buildx (trixie) failed"
  $SUDO mkdir -p "$PLUGIN_STORE"
  for deb in "$tmp"/debs/*.deb; do
    say "unpacking $(basename "$deb") into $PLUGIN_STORE"
    $SUDO dpkg-deb -x "$deb" "$PLUGIN_STORE"
  done
fi
$SUDO mkdir -p "$PLUGIN_DIR"
for plugin in docker-compose docker-buildx; do
  src="$PLUGIN_STORE/usr/libexec/docker/cli-plugins/$plugin"
  [ -x "$src" ] || die "$src missing after unpacking"
  $SUDO ln -sfn "$src" "$PLUGIN_DIR/$plugin"
  say "linked $PLUGIN_DIR/$plugin -> $src"
done
compose_v2 || die "docker compose v2 still not usable (docker compose version: $(docker compose version 2>&1))"
have_buildx || die "docker buildx still not usable"
say "ready: $(docker compose version | head -n1); $(docker buildx version | head -n1)"
