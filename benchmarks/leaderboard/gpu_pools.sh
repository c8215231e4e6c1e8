#!/bin/bash
# Several gpu_run.sh pools at once, in the background, so that one run spans several device calls
# (a call lasts at most 10 minutes; the machine stays warm while calls follow each other). Run from
# the repository root on the device, after a call that installed the wheels (gpu_run.sh, SUITES=):
#
#   MODE=start POOLS=benchmarks/leaderboard/pools/NAME.txt T=1300 bash benchmarks/leaderboard/gpu_pools.sh
#   MODE=wait SLEEP=560 bash benchmarks/leaderboard/gpu_pools.sh     # next calls: sleep, show progress
#   MODE=pack bash benchmarks/leaderboard/gpu_pools.sh              # wait for the pools, check, pack
#
# POOLS: a file of lines `JOBS SUITE [leaderboard run flags ...]` (# comments); each line is one
# gpu_run.sh with its own worker processes, all stopped T seconds after the start. Logs:
# /tmp/pools/N.log. REC as gpu_run.sh (default /tmp/records). `pack` runs `leaderboard check` on
# every record (with the trajectories, here) and brings back the records without trajectories.
#
# `start` copies the checkout to STABLE (default /tmp/cg) and runs the pools from there: every device
# call re-sends the working tree, and workers that import from it mid-copy fail (seen 2026-11-25:
# "No module named ...", "directory without config.json"). GPU memory bounds JOBS: a smollm2 worker
# holds ~5-7 GB (capacity x batch slots), so ~11 of them beside 12 babyai-tiny workers filled an
# H100 (CUDA out of memory); keep the sum of pools' JOBS x per-worker memory under the card's.
set -u
MODE=${MODE:-wait}
REC=${REC:-/tmp/records}
STABLE=${STABLE:-/tmp/cg}
mkdir -p /tmp/pools
case "$MODE" in
start)
  if [ "$PWD" != "$STABLE" ]; then
    rm -rf "$STABLE" && mkdir -p "$STABLE"
    tar cf - . | tar xf - -C "$STABLE"
    cp "$POOLS" "$STABLE/.pools.txt" && POOLS="$STABLE/.pools.txt"
  fi
  cd "$STABLE" || exit 1
  HERE=benchmarks/leaderboard
  i=0
  grep -v -E '^\s*(#|$)' "$POOLS" | while read -r jobs suite flags; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    SUITES="$suite" JOBS="$jobs" T="${T:-1300}" REC="$REC" setsid nohup bash "$HERE/gpu_run.sh" $flags \
      >"/tmp/pools/$i.log" 2>&1 </dev/null &
    echo "pool $i: $jobs jobs, $suite $flags"
  done
  sleep "${SLEEP:-5}"
  ;;
wait)
  HERE=$STABLE/benchmarks/leaderboard
  sleep "${SLEEP:-560}"
  ;;
pack)
  HERE=$STABLE/benchmarks/leaderboard
  while pgrep -f "gpu_run.sh" >/dev/null; do sleep 5; done
  ;;
esac
date -u
for f in /tmp/pools/*.log; do echo "== $f"; grep -E "^== |rc=" "$f" | tail -4; done
find "$REC" -name submission.json | sed "s#$REC/##" | sort | tr '\n' ' '; echo
if [ "$MODE" = pack ]; then
  SUITES= CHECK=1 PACK=1 TRAJ=0 REC="$REC" bash "$HERE/gpu_run.sh"
  cp /tmp/pools/*.log "$OUT/" 2>/dev/null
fi
