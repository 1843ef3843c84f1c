#!/usr/bin/env bash
# Creates pdserve's Secrets in the cluster: the same credentials compose generates
# (`pdserve secrets`, services/secrets.py), each component's share in its own Secret, plus the
# router's admin API key (the workers' preStop drain and the autoscaler use it).
#
#   deploy/kubernetes/secrets.sh [--dir DIR] [--namespace NS] [--print]
#
# DIR (default ./pdserve-secrets, owner-only) keeps the credentials: run it again and they stay
# the same (the store's objects stay checkable). --print writes the Secrets as YAML to stdout
# instead of applying them (kubectl needs no cluster for that). Needs `pdserve` (or $PDSERVE),
# python3 and kubectl on PATH.
#
#   Secret            keys                                             mounted in
#   pdserve-store     kv-auth, kv-admin-token, redis-password          KV store front-ends
#   pdserve-worker    kv-worker-token, kv-integrity-key, worker-token  prefill / decode pods
#   pdserve-router    worker-token                                     router, autoscaler
#   pdserve-redis     redis.conf, redis-password                       Redis pods, cluster Job
#   pdserve-admin     admin-api-key                                    router, workers, autoscaler
# Optional (not made here): pdserve-api-keys, key api-keys (comma-separated client API keys).
set -euo pipefail
dir=./pdserve-secrets
namespace=pdserve
print=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir=$2; shift 2 ;;
    --namespace) namespace=$2; shift 2 ;;
    --print) print=1; shift ;;
    *) echo "usage: $0 [--dir DIR] [--namespace NS] [--print]" >&2; exit 2 ;;
  esac
done
PDSERVE=${PDSERVE:-pdserve}
KUBECTL=${KUBECTL:-kubectl}

umask 077
$PDSERVE secrets --dir "$dir/all" --share "store=$dir/store" --share "worker=$dir/worker" \
  --share "router=$dir/router" --share "redis=$dir/redis" >&2
mkdir -p "$dir/admin"
if [ ! -s "$dir/admin/admin-api-key" ]; then
  python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > "$dir/admin/admin-api-key"
fi

render() {
  for role in store worker router redis admin; do
    echo "---"
    $KUBECTL create secret generic "pdserve-$role" --namespace "$namespace" \
      --from-file="$dir/$role" --dry-run=client -o yaml
  done
}
if [ "$print" = 1 ]; then
  render
else
  render | $KUBECTL apply -f -
fi
