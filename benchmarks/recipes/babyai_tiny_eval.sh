#!/usr/bin/env bash
# The babyai-tiny model card's evaluations, as parallel single-thread processes (chunks of seeds),
# then merged per evaluation with babyai_tiny_card.py --merge:
#   full/                 full KV, BALROG protocol, 5 tasks x seeds 0..49
#   mem_<mode>/           the memory-dependent variant: open / putnext / pick_up_seq_go_to, seeds
#                         0..29, KV budget 384 (compact 192 tokens to 25 %) for attention_matching and
#                         markovian; full KV for none (the full run's chunks of those seeds)
#   quickstart/           the README's main command (attention matching, max_kv_len 1024, seeds 0..9)
# Usage, from the repository root:  bash benchmarks/recipes/babyai_tiny_eval.sh MODEL OUT [JOBS]
# (always the `reasoning` prompt the recipe trains: an SFT output directory has no compaction_gym.json
# that would say so — only the installed model does)
# Needs the package importable (PYTHONPATH or an install); JOBS defaults to the number of cores.
# EPS (episodes per process, 10), FULL_SEEDS / MEM_SEEDS (first seeds of the chunks) shrink it for smoke tests.
set -u
MODEL=${1:?model directory or name}
O=${2:?output directory}
JOBS=${3:-$(nproc)}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$O/parts"
TASKS="goto pickup open putnext pick_up_seq_go_to"
MEM_TASKS="open putnext pick_up_seq_go_to"
MEM="--max-kv-len 384 --compact-window 192 --ratio 0.25"
EPS=${EPS:-10}
FULL_SEEDS=${FULL_SEEDS:-0 10 20 30 40}
MEM_SEEDS=${MEM_SEEDS:-0 10 20}
jobs_list() {  # one line per process, the slowest tasks first: NAME SEED EPISODES TASK FLAGS...
  for t in $MEM_TASKS; do for s in $FULL_SEEDS; do echo "full $s $EPS $t --mode none"; done; done
  for t in $MEM_TASKS; do for s in $MEM_SEEDS; do
    echo "mem_attention_matching $s $EPS $t --mode attention_matching $MEM"
    echo "mem_markovian $s $EPS $t --mode markovian $MEM"
    # full KV on a seed chunk the full run already plays is that run's chunk (merged below)
    case " $FULL_SEEDS " in *" $s "*) ;; *) echo "mem_none $s $EPS $t --mode none" ;; esac
  done; done
  for t in goto pickup; do for s in $FULL_SEEDS; do echo "full $s $EPS $t --mode none"; done; done
  for t in $TASKS; do echo "quickstart 0 $EPS $t --mode attention_matching --max-kv-len 1024"; done
}
run_one() {
  local name=$1 seed=$2 eps=$3 task=$4
  shift 4
  python3 -m compaction_gym.cli eval --model "$MODEL" --task "$task" --seed "$seed" --episodes "$eps" \
    --batch "$eps" --capacity 16384 --device cpu --prompt reasoning --no-progress "$@" \
    --output "$O/parts/${name}_${task}_$seed" > "$O/parts/${name}_${task}_$seed.log" 2>&1
  echo "$name $task $seed exit $?"
}
export -f run_one
export MODEL O
T0=$(date +%s)
jobs_list > "$O/parts/jobs.txt"
# TIME_LIMIT (seconds): stop there and merge what finished (episodes of unfinished processes are lost)
timeout "${TIME_LIMIT:-100000}" xargs -P "$JOBS" -L 1 bash -c 'run_one "$@"' _ < "$O/parts/jobs.txt"
# on a timeout, stop the evaluations xargs had started (they write under $O/parts)
[ $? -eq 124 ] && pkill -f -- "--output $O/parts/" 2>/dev/null
for name in full mem_attention_matching mem_markovian mem_none quickstart; do
  args=()
  for d in "$O"/parts/${name}_*/; do [ -f "$d/summary.json" ] && args+=(--merge "$d"); done
  if [ "$name" = mem_none ]; then
    for t in $MEM_TASKS; do for s in $MEM_SEEDS; do
      d="$O/parts/full_${t}_$s/"
      [ -f "$d/summary.json" ] && args+=(--merge "$d")
    done; done
  fi
  [ ${#args[@]} -gt 0 ] || continue
  python3 benchmarks/recipes/babyai_tiny_card.py "${args[@]}" --merged "$O/$name" > /dev/null
done
table() {  # the evaluations among $@ that were merged, as one table
  local args=() name
  for name in "$@"; do [ -f "$O/$name/summary.json" ] && args+=(--eval "$O/$name"); done
  [ ${#args[@]} -eq 0 ] || python3 benchmarks/recipes/babyai_tiny_card.py "${args[@]}"
}
{ table full quickstart; echo; table mem_none mem_markovian mem_attention_matching; } | tee "$O/tables.md"
echo "evaluations took $(( $(date +%s) - T0 )) s"
