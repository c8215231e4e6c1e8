#!/usr/bin/env bash
# The babyai-tiny recipe on a GPU host, in two bounded phases (see README.md here):
#   PHASE=demos  step 1 on the host's CPUs: `train demos --config babyai_tiny_demos.toml` with one
#                recording process per core (the episodes do not depend on the worker count);
#   PHASE=sft    step 2 on the GPU: `train sft --config babyai_tiny.toml`, then a quick held-out
#                evaluation; copies the weights (split in 15 MB parts), logs and manifests to OUT.
#   PHASE=stage2 steps 3-4 (babyai_tiny_stage2*.toml): more demos of open/putnext/seq, one SFT epoch more.
#   PHASE=stage3 steps 5-7 (babyai_tiny_stage3*.toml): opening-turn demos + replayed whole episodes,
#                two SFT epochs from the stage-2 model, then the quick evaluation.
# Demos whose trees.jsonl (or trees.jsonl.gz) already exist under RECIPE_DIR are reused, not re-recorded.
# Usage, from the repository root:  PHASE=demos|sft|stage2|stage3 bash benchmarks/recipes/babyai_tiny_gpu.sh WHEELS OUT
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

# record demos: CONFIG MODEL NAME -> $R/NAME, its manifest in $O (kept if $R/NAME has its trees)
record() {
  [ -f "$R/$3/trees.jsonl.gz" ] && [ ! -f "$R/$3/trees.jsonl" ] && gunzip -k "$R/$3/trees.jsonl.gz"
  if [ -f "$R/$3/trees.jsonl" ]; then
    stamp "$3: reusing $R/$3/trees.jsonl"; cp "$R/$3/manifest.json" "$O/$3_manifest.json"; return
  fi
  cg demos --config "$1" --workers "$WORKERS" --threads 1 --device cpu --model "$2" \
    --output-dir "$R/$3" ${DEMO_EXTRA:-} > "$O/$3.log" 2>&1
  stamp "$3 exit $?: $(tail -1 "$O/$3.log")"
  cp "$R/$3/manifest.json" "$O/$3_manifest.json"
  tail -c 2000 "$O/$3.log" > "$O/$3_tail.log"; rm -f "$O/$3.log"
}
# tree SFT: CONFIG MODEL NAME DEMOS... -> $R/NAME (checkpoints: a timeout still leaves the last one);
# sets M to the model directory and ships its weights (15 MB parts), trainer state and log tail to $O
train() {
  local cfg=$1 model=$2 name=$3 d datasets=()
  shift 3
  for d in "$@"; do
    [ -f "$R/$d/trees.jsonl" ] || gunzip -k "$R/$d/trees.jsonl.gz"
    datasets+=("$R/$d/trees.jsonl")
  done
  timeout "$SFT_T" $py -m compaction_gym.cli train sft --config "$cfg" --model "$model" \
    --dataset "${datasets[@]}" --output-dir "$R/$name" $EXTRA > "/tmp/$name.log" 2>&1
  stamp "$name exit $?"
  local last
  last=$(ls -d "$R/$name"/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1)
  M=$R/$name
  [ -f "$M/model.safetensors" ] || M=$last
  stamp "model dir: $M"
  (cd "$M" && split -b 15M model.safetensors "$O/$name.safetensors.part-" && sha256sum model.safetensors | tee -a "$O/run.log")
  cp "$last/trainer_state.json" "$O/${name}_trainer_state.json"; tail -c 3000 "/tmp/$name.log" > "$O/${name}_tail.log"
}

case "$PHASE" in
  demos)  # step 1
    record benchmarks/recipes/babyai_tiny_demos.toml "$R/base" demos
    gzip -c "$R/demos/trees.jsonl" > "$O/trees.jsonl.gz"
    exit 0 ;;
  stage2)  # steps 3-4: more demos of the hard tasks, one more SFT epoch
    record benchmarks/recipes/babyai_tiny_stage2_demos.toml "$R/base" demos2
    train benchmarks/recipes/babyai_tiny_stage2.toml "$R/sft" sft2 demos2
    exit 0 ;;
  stage3)  # steps 5-7: opening-turn demos and replayed episodes, two SFT epochs, the quick evaluation
    record benchmarks/recipes/babyai_tiny_stage3_demos.toml "$R/base" demos3
    record benchmarks/recipes/babyai_tiny_stage3_replay_demos.toml "$R/base" demos3_replay
    train benchmarks/recipes/babyai_tiny_stage3.toml "$R/sft2" sft3 demos3 demos3_replay ;;
  sft)  # step 2, then the quick evaluation below
    train benchmarks/recipes/babyai_tiny.toml "$R/base" sft demos ;;
  *) echo "PHASE must be demos, sft, stage2 or stage3, got $PHASE" >&2; exit 2 ;;
esac

# quick held-out evaluation (seeds 0..EVAL_EPS-1, full KV, the model's own prompt format) on the GPU
[ "$EVAL_EPS" -gt 0 ] || { stamp "done (no quick evaluation: EVAL_EPS=0)"; exit 0; }
timeout 120 $py - "$M" "$EVAL_EPS" <<'PY' > /tmp/eval.log 2>&1
import json, sys
import torch
from compaction_gym.evaluation import evaluate
dev = "cuda" if torch.cuda.is_available() else "cpu"
kw = {"device": dev, "capacity": 16384, **({"fast": False} if dev == "cuda" else {})}
s = evaluate(sys.argv[1], "AttnMatch-BabyAI-v0", prompt="reasoning", episodes=int(sys.argv[2]), batch=int(sys.argv[2]),
             output="/tmp/eval", engine_kwargs=kw, progress=False)
print(json.dumps({t: round(v["progression"]["mean"], 1) for t, v in s["tasks"].items()}),
      "overall", round(s["overall"]["progression"]["mean"], 1))
PY
stamp "eval: $(tail -1 /tmp/eval.log)"
stamp "done"
