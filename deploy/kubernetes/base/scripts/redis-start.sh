#!/bin/sh
# Starts one Redis Cluster node of the pdserve-redis StatefulSet.
# Its identity (node id, slots, peers) is $DATA_DIR/nodes.conf, kept on the pod's volume. The
# pods' IPs change when they restart, so before starting, every node that nodes.conf names by its
# stable hostname gets that name's current address (the others' answers fix the rest).
# Environment (the defaults are the pod's): POD_NAMESPACE, REDIS_PORT [6379], DATA_DIR [/data],
# SECRETS_DIR [/run/pdserve-secrets: redis.conf and redis-password], ANNOUNCE_HOSTNAME
# [<hostname>.pdserve-redis.<namespace>.svc].
set -eu
: "${POD_NAMESPACE:=pdserve}"
: "${REDIS_PORT:=6379}"
: "${DATA_DIR:=/data}"
: "${SECRETS_DIR:=/run/pdserve-secrets}"
: "${ANNOUNCE_HOSTNAME:=$(hostname).pdserve-redis.$POD_NAMESPACE.svc}"
conf=$DATA_DIR/redis-runtime.conf
nodes=$DATA_DIR/nodes.conf
umask 077
# The password: redis.conf from the Secret (requirepass), and masterauth so that a replica can
# follow its master; written to the volume (owner-only), never on the command line.
{
  echo "include $SECRETS_DIR/redis.conf"
  echo "masterauth $(cat "$SECRETS_DIR/redis-password")"
} > "$conf"
if [ -f "$nodes" ]; then
  cp "$nodes" "$nodes.bak"
  # Lines: <id> <ip>:<port>@<cport>,<hostname> <flags> ... (the hostname each node announced)
  awk '{
    split($2, a, ",");
    host = a[2];
    if (host != "") {
      cmd = "getent hosts " host;
      ip = "";
      if ((cmd | getline line) > 0) { split(line, f, " "); ip = f[1] }
      close(cmd);
      if (ip != "") { sub(/^[^:]*:/, ip ":", $2) }
    }
    print
  }' "$nodes.bak" > "$nodes"
fi
exec redis-server "$conf" --port "$REDIS_PORT" \
  --cluster-enabled yes --cluster-config-file "$nodes" --cluster-node-timeout 5000 \
  --cluster-announce-hostname "$ANNOUNCE_HOSTNAME" --cluster-preferred-endpoint-type hostname \
  --bind 0.0.0.0 --protected-mode no --dir "$DATA_DIR" --save "" --appendonly no
