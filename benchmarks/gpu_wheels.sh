#!/usr/bin/env bash
# Download the wheels that `compaction-gym serve` and benchmarks/bench_server.py need and the GPU
# machine's Python (3.12, x86_64) may lack, into .whlS/ (git-ignored; carry it: `carry: [".whlS"]`).
# Run here, from the repository root, where PyPI is reachable:
#
#   bash benchmarks/gpu_wheels.sh          # 22 wheels, 8.9 MB (du -sh; keep .whlS under 9 MB: it is carried)
#
# Assumed present there: torch, transformers, numpy, safetensors, tokenizers and what they require.
# Everything else the server imports is listed: the HTTP stack (fastapi + opentelemetry-api, which
# fastapi >= 0.16x imports at start, starlette, uvicorn, click, h11, httpx, httpcore, anyio, idna,
# certifi), uvloop and httptools (uvicorn's C event loop and HTTP parser, which it picks when
# present), pydantic (pydantic-core, uvloop and httptools are the compiled wheels: cp312), and
# gymnasium (imported by `import compaction_gym`). Versions are pinned to the ones tested on the CPU machine.
# On the GPU (benchmarks/gpu_server.sh does it):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whlS/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
set -eu
DEST=${1:-.whlS}
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" \
  fastapi==0.165.0 opentelemetry-api==1.45.2 starlette==1.10.0 uvicorn==0.54.0 click==8.5.1 h11==0.16.0 \
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
  typing-extensions==4.16.0 annotated-doc==0.0.7 anyio==4.16.0 httpx==0.28.1 httpcore==1.0.9 idna==3.20 \
  certifi==2026.5.20 gymnasium==1.4.0 farama-notifications==0.0.6 cloudpickle==3.1.3 \
  uvloop==0.23.0 httptools==0.9.0
ls "$DEST"
du -sh "$DEST"
