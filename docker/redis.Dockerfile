# redis-server from Debian, for the KV store's redis backend in compose.yaml (no image registry
# is needed: any Debian base works, e.g. pdserve/base:bookworm from docker/build_images.sh).
#
#   docker build -f docker/redis.Dockerfile -t pdserve/redis:latest .
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# A fixed uid for the redis user, so compose's `secrets` service can hand Redis its password file.
RUN set -eux; \
    groupadd --system --gid 999 redis; \
    useradd --system --uid 999 --gid 999 --home-dir /var/lib/redis --shell /usr/sbin/nologin redis; \
    apt-get update; \
    apt-get install -y --no-install-recommends redis-server; \
    test "$(id -u redis)" = 999; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb; \
    redis-server --version
USER redis
EXPOSE 6379
# A cache, not a database: no snapshots, no append-only file; reachable from the compose network.
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"]
