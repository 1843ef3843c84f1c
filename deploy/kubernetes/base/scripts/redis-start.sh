#!/bin/sh
# Starts one Redis Cluster node of the pdserve-redis StatefulSet.
# Its identity (node id, slots, peers) is /data/nodes.conf, kept on the pod's volume. The pods'
# IPs change when they restart, so before starting, every peer that nodes.conf names by its
# stable hostname gets that name's current address (the others' answers fix the rest).
set -eu
: "${POD_NAMESPACE:=pdserve}"
conf=/data/redis-runtime.conf
umask 077
# The password: redis.conf from the Secret (requirepass), and masterauth so that a replica can
# follow its master; written to the volume (owner-only), never on the command line.
{
  echo "include /run/pdserve-secrets/redis.conf"
  echo "masterauth $(cat /run/pdserve-secrets/redis-password)"
} > "$conf"
if [ -f /data/nodes.conf ]; then
  cp /data/nodes.conf /data/nodes.conf.bak
  # Lines: <id> <ip>:<port>@<cport>,<hostname> <flags> ... (hostname: cluster-announce-hostname)
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
  }' /data/nodes.conf.bak > /data/nodes.conf
fi
exec redis-server "$conf" \
  --cluster-enabled yes --cluster-config-file /data/nodes.conf --cluster-node-timeout 5000 \
  --cluster-announce-hostname "$(hostname).pdserve-redis.$POD_NAMESPACE.svc" \
  --cluster-preferred-endpoint-type hostname \
  --bind 0.0.0.0 --protected-mode no --dir /data --save "" --appendonly no
