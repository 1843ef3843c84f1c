# redis-server from Debian, for the KV store's redis backend in compose.yaml (no image registry
# is needed: any Debian base works, e.g. pdserve/base:bookworm from docker/build_images.sh).
#
#   docker build -f docker/redis.Dockerfile -t pdserve/redis:latest .
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends redis-server; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb; \
    redis-server --version
USER redis
EXPOSE 6379
# A cache, not a database: no snapshots, no append-only file; reachable from the compose network.
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"]
