#!/usr/bin/env bash
# Flake hunt: runs the suite as `make test` does, RUNS times, with BURN CPU-burning processes
# beside it (each bounded by the run's own time limit and killed when the run ends), and prints
# each run's summary line and failures. Run from a fresh clone after `make test` set it up:
#
#   bash tests/flake_hunt.sh                 # 3 runs with 2 burners (both cores of a 2-core VM busy)
#   RUNS=1 BURN=0 bash tests/flake_hunt.sh   # one quiet run
#   RUNS=1 BURN=2 bash tests/flake_hunt.sh --runslow
#
# Environment: RUNS (3), BURN (2), LIMIT_S (3600: a run and its burners end by then),
# OUT (flake-hunt/: each run's full output), TEST_WORKERS (2, as make test). Extra arguments go
# to pytest. Exit status: 0 when every run passed.
set -uo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-3}
BURN=${BURN:-2}
LIMIT_S=${LIMIT_S:-3600}
OUT=${OUT:-flake-hunt}
TEST_WORKERS=${TEST_WORKERS:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
[ -x .venv/bin/python ] || { echo "no .venv: run make test (or make setup) first" >&2; exit 2; }
mkdir -p "$OUT"

burners=()
stop_burners() {
  for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null; done
  wait "${burners[@]}" 2>/dev/null
  burners=()
}
trap stop_burners EXIT

status=0
for run in $(seq 1 "$RUNS"); do
  for _ in $(seq 1 "$BURN"); do
    timeout "$LIMIT_S" python3 -c 'while True: pass' &
    burners+=($!)
  done
  log="$OUT/run-$run.log"
  start=$(date +%s)
  timeout "$LIMIT_S" .venv/bin/python -m pytest -q -ra -n "$TEST_WORKERS" --dist loadfile "$@" >"$log" 2>&1
  rc=$?
  stop_burners
  [ "$rc" = 0 ] || status=1
  summary=$(grep -E '(passed|failed|error).* in [0-9.]+s' "$log" | tail -1)
  echo "run $run (burners: $BURN, $(( $(date +%s) - start )) s, rc $rc): ${summary:-no summary (see $log)}"
  grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
done
exit $status
