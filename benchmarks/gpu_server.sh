#!/usr/bin/env bash
# Issue 28, target 2: the HTTP server on one GPU, in one device call (docs/benchmarks.md, "Server").
#
#   bash benchmarks/gpu_server.sh OUT_DIR
#
# 1. throughput: a random-weight Qwen3 shape (MODEL, default qwen3-0.6b, bf16) is saved with a small
#    tokenizer to /tmp and served by `compaction-gym serve --device cuda` (the engine's fast path);
#    64 sessions (8 client processes x 8 threads) open with a 200-token prompt, then step 12 times
#    (50-70 new tokens in, 32 sampled out at temperature 0.7); the same workload then runs in
#    process on the embedded engine. Prints server / embedded tokens/s (target >= 0.80) and the
#    client-side p50/p99 step latency.
# 2. head-of-line: p50/p99 of a 2-token request while 1000-token requests run back to back,
#    one-shot vs continuous batching (two servers on the same model folder).
# Each part runs under `timeout` (T1, T2 seconds; default 320 + 190) so a hang cannot eat the call;
# logs and JSON land in OUT_DIR (server_throughput.{log,json}, server_hol.{log,json}).
# Needs the wheels of benchmarks/gpu_wheels.sh in .whlS/ (carried: `carry: [".whlS"]`); without
# .whlS the machine's own packages are used. Expected wall time on an H100: ~5-6 minutes.
# PARTS (default "throughput hol") picks the parts: PARTS=throughput EXTRA=--no-fast-routes measures the
# server without its fast path (docs/server.md, "Performance") in a second call.
# DEVICE (default cuda) and EXTRA (flags appended to both parts, overriding the ones above) are for
# smoke tests on a CPU: DEVICE=cpu EXTRA="--sessions 2 --client-procs 2 --steps 1 ..." (WHEELS, SITE:
# the wheel folder and where it is installed, default .whlS and /tmp/site).
set -u
O=${1:-${OUT:-/tmp/server-out}}
MODEL=${MODEL:-qwen3-0.6b}
T1=${T1:-320}
T2=${T2:-190}
DEVICE=${DEVICE:-cuda}
EXTRA=${EXTRA:-}
mkdir -p "$O"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
WHEELS=${WHEELS:-.whlS}
SITE=${SITE:-/tmp/site}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    || exit 1
  export PYTHONPATH=$SITE:$PWD
fi
T0=$(date +%s)
stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }
python3 -c "import torch, transformers, fastapi, uvicorn, httpx, compaction_gym.servers.app; \
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '', \
'transformers', transformers.__version__)" || exit 1
python3 -c "import uvloop, httptools; print('uvloop', uvloop.__version__, 'httptools', httptools.__version__)" \
  || echo "uvloop/httptools missing: uvicorn falls back to asyncio + h11 (run benchmarks/gpu_wheels.sh)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null
B="python3 benchmarks/bench_server.py --model $MODEL --model-dir /tmp/cg-$MODEL --device $DEVICE"
PARTS=${PARTS:-throughput hol}
if [[ " $PARTS " == *" throughput "* ]]; then
stamp "throughput"
timeout -k 15 "$T1" $B --sessions 64 --client-procs 8 --prompt-len 200 --step-len 50-70 --new-tokens 32 \
  --steps 12 --sequential-steps 1 --temperature 0.7 --server-start-s 240 --json "$O/server_throughput.json" \
  $EXTRA >"$O/server_throughput.log" 2>&1
stamp "throughput exit $?"
grep -v "it/s\]" "$O/server_throughput.log" | tail -14
fi
[[ " $PARTS " == *" hol "* ]] || exit 0
stamp "head-of-line"
timeout -k 15 "$T2" $B --scenario head-of-line --probes 16 --long-tokens 1000 --server-start-s 120 \
  --json "$O/server_hol.json" $EXTRA >"$O/server_hol.log" 2>&1
stamp "head-of-line exit $?"
grep -v "it/s\]" "$O/server_hol.log" | tail -8
