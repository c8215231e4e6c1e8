#!/bin/bash
# Issue 24's GRPO run on the device machine, spread over several device calls (docs/grpo.md,
# "Running it on the device machine"). Each call lasts at most 10 minutes and re-sends the working
# tree, so the run starts in the background from a copy of the checkout and later calls only wait:
#
#   MODE=start MINUTES=20 bash benchmarks/recipes/grpo_babyai_memory/gpu.sh [run.py `all` flags]
#   MODE=wait SLEEP=540 bash benchmarks/recipes/grpo_babyai_memory/gpu.sh   # next calls, back to back
#   MODE=pack bash benchmarks/recipes/grpo_babyai_memory/gpu.sh             # wait for the end, bring back
#                                                                          # results + every variant's weights
#
# Needs the wheels the machine lacks (gymnasium, minigrid, pygame-ce, trl, datasets, dill,
# multiprocess, jsonschema + its three dependencies) carried in .whl* folders: start installs every
# `.whl*/*.whl` it finds into /tmp/site once. The machine goes back 30 s after a call ends: issue the
# next call at once. Flags after the mode go to `run.py all` (default: every variant + the baseline,
# `--fast`: CUDA-graph rollouts, whose Triton kernels compile in the first process). On a machine
# with several GPUs `all` spreads its processes over them (`--gpus N` for fewer).
#
# MINUTES  the whole run's wall budget (run.py all --minutes; default 20)
# OUTDIR   where the runs go on the machine (default /tmp/grpo)
# STABLE   the copy of the checkout the run imports from (default /tmp/grpo-src)
set -u
MODE=${MODE:-wait}
OUTDIR=${OUTDIR:-/tmp/grpo}
STABLE=${STABLE:-/tmp/grpo-src}
export PYTHONPATH=/tmp/site:$STABLE PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
progress() {
  date -u
  for f in "$OUTDIR"/*/log_history.jsonl; do
    [ -f "$f" ] && echo "$(dirname "$f" | xargs basename): $(grep -c '"step"' "$f") log lines, last: $(tail -1 "$f" | cut -c1-240)"
  done
  tail -3 /tmp/grpo-all.log 2>/dev/null | cut -c1-300
}
case "$MODE" in
start)
  if [ ! -f /tmp/site/.installed ] && ls .whl*/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl || exit 1
    touch /tmp/site/.installed
  fi
  rm -rf "$STABLE" && mkdir -p "$STABLE" && tar cf - --exclude='./.whl*' --exclude=./.carry . | tar xf - -C "$STABLE"
  cd "$STABLE" || exit 1
  python3 -c "import gymnasium, minigrid, trl" || exit 1
  mkdir -p "$OUTDIR"
  # shellcheck disable=SC2068
  setsid nohup python3 benchmarks/recipes/grpo_babyai_memory/run.py all --out "$OUTDIR" \
    --minutes "${MINUTES:-20}" ${@:---fast} >/tmp/grpo-all.log 2>&1 </dev/null &
  sleep "${SLEEP:-30}"
  progress
  ;;
wait)
  sleep "${SLEEP:-540}"
  progress
  ;;
pack)
  while pgrep -f "grpo_babyai_memory/run.py" >/dev/null; do sleep 5; done
  progress
  # the curves, logs, metrics, metadata and held-out results; checkpoints stay on the machine
  tar czf "$OUT/grpo.tar.gz" -C "$OUTDIR" --exclude='checkpoint-*' --exclude='*.safetensors' \
    --exclude='*.safetensors.part-*' --exclude='*.pt' --exclude='*.bin' .
  cp /tmp/grpo-all.log "$OUT/" 2>/dev/null
  # each variant's evaluated weights (its equal-steps model, else the final one) in 15 MB parts:
  # `cat NAME.safetensors.part-* > model.safetensors` beside that model's compaction_gym.json
  for train in "$OUTDIR"/*/train.json; do
    [ -f "$train" ] || continue
    run=$(dirname "$train")
    model=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('model', ''))" "$run/eval.json" 2>/dev/null)
    [ -f "$model/model.safetensors" ] || model=$run/model
    [ -f "$model/model.safetensors" ] && split -b 15M -d "$model/model.safetensors" "$OUT/$(basename "$run").safetensors.part-"
  done
  ls -la "$OUT"
  ;;
*)
  echo "MODE must be start, wait or pack, got $MODE" >&2
  exit 2
  ;;
esac
