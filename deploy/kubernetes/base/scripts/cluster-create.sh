#!/bin/sh
# Creates the Redis Cluster over the pdserve-redis StatefulSet's pods, once: waits until every
# node answers, does nothing when the cluster already serves every slot, else `redis-cli
# --cluster create` (REDIS_REPLICAS_PER_MASTER replicas each) and waits until it serves them all.
# Bounded: exits 1 after about 10 minutes of waiting (the Job retries it).
# Environment: REDIS_NODES (host:port, space-separated), REDIS_REPLICAS_PER_MASTER [1],
# SECRETS_DIR [/run/pdserve-secrets], WAIT_TRIES [300, 2 s apart].
set -eu
: "${SECRETS_DIR:=/run/pdserve-secrets}"
: "${WAIT_TRIES:=300}"
REDISCLI_AUTH=$(cat "$SECRETS_DIR/redis-password")
export REDISCLI_AUTH
replicas=${REDIS_REPLICAS_PER_MASTER:-1}
first=${REDIS_NODES%% *}
cli() {  # cli host:port args...
  node=$1
  shift
  redis-cli -h "${node%:*}" -p "${node##*:}" "$@"
}
addrs=""
n=0
for node in $REDIS_NODES; do
  tries=0
  until [ "$(cli "$node" ping 2>/dev/null)" = PONG ]; do
    tries=$((tries + 1))
    [ "$tries" -lt "$WAIT_TRIES" ] || { echo "$node does not answer" >&2; exit 1; }
    sleep 2
  done
  # CLUSTER MEET takes addresses: the name's current one.
  ip=$(getent hosts "${node%:*}" | awk '{print $1; exit}')
  addrs="$addrs $ip:${node##*:}"
  n=$((n + 1))
done
if cli "$first" cluster info | grep -q '^cluster_state:ok'; then
  echo "the Redis Cluster already serves every slot"
  exit 0
fi
known=$(cli "$first" cluster info | awk -F: '/^cluster_known_nodes:/ {print $2 + 0}')
if [ "${known:-1}" -gt 1 ]; then
  # Part of a cluster that does not serve every slot: a person decides (redis-cli --cluster fix).
  echo "$first knows $known nodes but the cluster does not serve every slot; see docs/kubernetes.md" >&2
  exit 1
fi
# shellcheck disable=SC2086
redis-cli --cluster create $addrs --cluster-replicas "$replicas" --cluster-yes
tries=0
until cli "$first" cluster info | grep -q '^cluster_state:ok'; do
  tries=$((tries + 1))
  [ "$tries" -lt 60 ] || { echo "the cluster was created but does not serve every slot" >&2; exit 1; }
  sleep 1
done
echo "the Redis Cluster serves every slot: $n nodes, $replicas replica(s) per master"
