#!/bin/sh
# Creates the Redis Cluster over the pdserve-redis StatefulSet's pods, once: waits until every
# pod answers, does nothing when the cluster already serves, else `redis-cli --cluster create`
# (masters and replicas by REDIS_REPLICAS_PER_MASTER) and waits until it serves every slot.
# Bounded: exits 1 after about 10 minutes (the Job retries it).
set -eu
REDISCLI_AUTH=$(cat /run/pdserve-secrets/redis-password)
export REDISCLI_AUTH
n=${REDIS_NODES:-6}
replicas=${REDIS_REPLICAS_PER_MASTER:-1}
first=pdserve-redis-0.pdserve-redis
addrs=""
i=0
while [ "$i" -lt "$n" ]; do
  host=pdserve-redis-$i.pdserve-redis
  tries=0
  until [ "$(redis-cli -h "$host" ping 2>/dev/null)" = PONG ]; do
    tries=$((tries + 1))
    [ "$tries" -lt 300 ] || { echo "$host does not answer" >&2; exit 1; }
    sleep 2
  done
  # CLUSTER MEET takes addresses: the name's current one.
  ip=$(getent hosts "$host" | awk '{print $1; exit}')
  addrs="$addrs $ip:6379"
  i=$((i + 1))
done
if redis-cli -h "$first" cluster info | grep -q '^cluster_state:ok'; then
  echo "the Redis Cluster already serves every slot"
  exit 0
fi
known=$(redis-cli -h "$first" cluster info | awk -F: '/^cluster_known_nodes:/ {print $2+0}')
if [ "${known:-1}" -gt 1 ]; then
  # Part of a cluster that does not serve every slot: a person decides (redis-cli --cluster fix).
  echo "$first knows $known nodes but the cluster does not serve every slot; see docs/kubernetes.md" >&2
  exit 1
fi
# shellcheck disable=SC2086
redis-cli --cluster create $addrs --cluster-replicas "$replicas" --cluster-yes
tries=0
until redis-cli -h "$first" cluster info | grep -q '^cluster_state:ok'; do
  tries=$((tries + 1))
  [ "$tries" -lt 60 ] || { echo "the cluster was created but does not serve every slot" >&2; exit 1; }
  sleep 2
done
echo "the Redis Cluster serves every slot: $n nodes, $replicas replica(s) per master"
