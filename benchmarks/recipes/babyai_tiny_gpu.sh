#!/usr/bin/env bash
# The babyai-tiny recipe on a GPU host, in two bounded phases (see README.md here):
#   PHASE=demos  step 1 on the host's CPUs: `train demos --config babyai_tiny_demos.toml` with one
#                recording process per core (the episodes do not depend on the worker count);
#   PHASE=sft    step 2 on the GPU: `train sft --config babyai_tiny.toml`, then a quick held-out
#                evaluation; copies the weights (split in 15 MB parts), logs and manifests to OUT.
#   PHASE=stage2 steps 3-4 (babyai_tiny_stage2*.toml): more demos of open/putnext/seq, one SFT epoch more.
# Usage, from the repository root:  PHASE=demos|sft|stage2 bash benchmarks/recipes/babyai_tiny_gpu.sh WHEELS OUT
# WHEELS holds the packages the GPU image lacks (trl, datasets, gymnasium, minigrid, pygame-ce, ...).
set -u
W=${1:-runs/babyai-tiny/gpu_carry/wheels}
O=${2:-${OUT:-/tmp/babyai-out}}
PHASE=${PHASE:-demos}
SFT_T=${SFT_T:-480}
EVAL_EPS=${EVAL_EPS:-20}
WORKERS=${WORKERS:-$(nproc)}
R=${RECIPE_DIR:-runs/babyai-tiny}   # base/, demos/, sft/ (the configs' paths)
EXTRA=${EXTRA:-}                     # extra flags for the SFT command (smoke tests)
DEMO_EXTRA=${DEMO_EXTRA:-}           # extra flags for the demos command (smoke tests)
mkdir -p "$O"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$O/run.log"; }
py=python3
if [ -d "$W" ] && [ -z "${NO_WHEELS:-}" ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$W"/*.whl || exit 1
  if [ "$($py -c 'import pyarrow; print(int(pyarrow.__version__.split(".")[0]) >= 24)')" != "True" ]; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$W"/alt/*.whl || exit 1
  fi
  export PYTHONPATH=/tmp/site:$PWD
fi
cg() { $py -m compaction_gym.cli "$@"; }
stamp "$($py -c "import torch, transformers, trl, datasets, gymnasium, minigrid; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '', 'transformers', transformers.__version__, 'trl', trl.__version__)" 2>&1 | tail -1)"

if [ "$PHASE" = demos ]; then
  cg train demos --config benchmarks/recipes/babyai_tiny_demos.toml --workers "$WORKERS" --threads 1 \
    --device cpu --model "$R/base" --output-dir "$R/demos" ${DEMO_EXTRA:-} > "$O/demos.log" 2>&1
  stamp "demos exit $?: $(tail -1 "$O/demos.log")"
  cp "$R/demos/manifest.json" "$O/demos_manifest.json"
  gzip -c "$R/demos/trees.jsonl" > "$O/trees.jsonl.gz"
  tail -c 2000 "$O/demos.log" > "$O/demos_tail.log"; rm -f "$O/demos.log"
  exit 0
fi

if [ "$PHASE" = stage2 ]; then  # steps 3-4: more demos of the hard tasks, one more SFT epoch
  cg train demos --config benchmarks/recipes/babyai_tiny_stage2_demos.toml --workers "$WORKERS" --threads 1 \
    --device cpu --model "$R/sft" --output-dir "$R/demos2" ${DEMO_EXTRA:-} > "$O/demos2.log" 2>&1
  stamp "demos2 exit $?: $(tail -1 "$O/demos2.log")"
  cp "$R/demos2/manifest.json" "$O/demos2_manifest.json"; rm -f "$O/demos2.log"
  timeout "$SFT_T" $py -m compaction_gym.cli train sft --config benchmarks/recipes/babyai_tiny_stage2.toml \
    --model "$R/sft" --dataset "$R/demos2/trees.jsonl" --output-dir "$R/sft2" $EXTRA > /tmp/sft2.log 2>&1
  stamp "sft2 exit $?"
  M=$R/sft2
  [ -f "$M/model.safetensors" ] || M=$(ls -d "$R"/sft2/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1)
  (cd "$M" && split -b 15M model.safetensors "$O/model2.safetensors.part-" && sha256sum model.safetensors | tee -a "$O/run.log")
  S=$(ls -d "$R"/sft2/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1)
  cp "$S/trainer_state.json" "$O/trainer_state2.json"; tail -c 3000 /tmp/sft2.log > "$O/sft2_tail.log"
  exit 0
fi

# step 2: tree SFT on the GPU (checkpoints every 250 steps: a timeout still leaves the last one)
timeout "$SFT_T" $py -m compaction_gym.cli train sft --config benchmarks/recipes/babyai_tiny.toml \
  --model "$R/base" --dataset "$R/demos/trees.jsonl" --output-dir "$R/sft" $EXTRA > /tmp/sft.log 2>&1
stamp "sft exit $?"
M=$R/sft
[ -f "$M/model.safetensors" ] || M=$(ls -d "$R"/sft/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1)
stamp "model dir: $M"
(cd "$M" && split -b 15M model.safetensors "$O/model.safetensors.part-" && sha256sum model.safetensors | tee -a "$O/run.log")
S=$(ls -d "$R"/sft/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1)
cp "$S/trainer_state.json" "$O/trainer_state.json"; tail -c 3000 /tmp/sft.log > "$O/sft_tail.log"

# quick held-out evaluation (seeds 0..EVAL_EPS-1, full KV, the model's own prompt format) on the GPU
timeout 120 $py - "$M" "$EVAL_EPS" <<'PY' > /tmp/eval.log 2>&1
import json, sys
import torch
from compaction_gym.agents.evaluate import evaluate
dev = "cuda" if torch.cuda.is_available() else "cpu"
kw = {"device": dev, "capacity": 16384, **({"fast": False} if dev == "cuda" else {})}
s = evaluate(sys.argv[1], "AttnMatch-BabyAI-v0", prompt="reasoning", episodes=int(sys.argv[2]), batch=int(sys.argv[2]),
             output="/tmp/eval", engine_kwargs=kw, progress=False)
print(json.dumps({t: round(v["progression"]["mean"], 1) for t, v in s["tasks"].items()}),
      "overall", round(s["overall"]["progression"]["mean"], 1))
PY
stamp "eval: $(tail -1 /tmp/eval.log)"
stamp "done"
