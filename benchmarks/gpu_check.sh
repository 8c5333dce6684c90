#!/usr/bin/env bash
# shepherd's --device cuda path on a lent GPU machine, in one call (docs/GPU.md has what it measured).
#
#   bash benchmarks/gpu_check.sh WHEELS_DIR TOKENIZER_DIR
#
# WHEELS_DIR: cp312 wheels of what the machine lacks (fastapi, pydantic, uvicorn, openai, ...),
# installed with --no-deps into /tmp/site; TOKENIZER_DIR: the default model's tokenizer.json and
# tokenizer_config.json (benchmarks/make_shaped_model.py --export-tokenizer). Builds a folder of
# SmolLM2-135M's shape with seeded random weights, then: the CUDA tests, greedy tokens cuda vs cpu,
# and served throughput at 1/16/64 streams. Every step has its own timeout; output goes to
# $OUT/log (or ./gpu_check.log). Nothing here needs the network.
# A dry run on a CPU machine: DEVICE=cpu PY=.venv/bin/python STREAMS=1,4 TOKENS=16 \
#   bash benchmarks/gpu_check.sh skip TOKENIZER_DIR
set -u
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
STREAMS=${STREAMS:-1,16,64}
TOKENS=${TOKENS:-128}
WHL=${1:?wheels dir}; [ "$WHL" = skip ] || WHL=$(cd "$WHL" && pwd)
TOK=$(cd "${2:?tokenizer dir}" && pwd)
cd "$(dirname "$0")/.."
LOG=${OUT:-.}/log
[ -n "${OUT:-}" ] || LOG=./gpu_check.log
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SHEPHERD_CACHE_DIR=/tmp/shepherd-kernels
T0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
M=/tmp/shaped-smollm2-135m

step "machine"
nvidia-smi -L
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,power.draw --format=csv
$PY -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda, '|', torch.cuda.is_available() and torch.cuda.get_device_name(0), torch.cuda.is_available() and torch.cuda.get_device_capability(0), '|', torch.cuda.device_count(), 'GPU(s)')"
lscpu | grep -E "^Model name|^CPU\(s\)"; which gcc || echo "no gcc"

step "wheels -> /tmp/site"
[ "$WHL" = skip ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
$PY -c "import fastapi, pydantic, uvicorn, openai, zmq, gguf, shepherd.server.openai_api; print('imports ok: fastapi', fastapi.__version__, 'pydantic', pydantic.__version__, 'openai', openai.__version__)" || exit 1
timeout 60 $PY -c "import time; t=time.time(); from shepherd.model import kernels; print('fused CPU kernels:', 'built' if kernels.load() else 'NOT available', f'{time.time()-t:.1f} s')"

step "model: SmolLM2-135M's shape, seeded random weights (bf16)"
$PY benchmarks/make_shaped_model.py $M --tokenizer "$TOK" || exit 1
md5sum $M/model.safetensors

step "pytest: the cuda param of tests/test_batch_invariance.py"
SHEPHERD_TEST_MODEL=$M timeout 100 $PY -m pytest -q -x -p no:cacheprovider tests/test_batch_invariance.py -k cuda -rs 2>&1 | tail -25

step "greedy tokens: cpu (fused kernels, torch path) vs $DEVICE, alone vs batched"
timeout 70 $PY benchmarks/device_parity.py --model $M --devices cpu/fused,cpu/torch,$DEVICE --prompts 8 --tokens 32 2>&1 | grep -v " INFO "

step "served: shepherd serve --device $DEVICE, openai client, $STREAMS streams x $TOKENS tokens"
mkdir -p out
timeout 150 $PY benchmarks/throughput.py --model $M --device $DEVICE --streams $STREAMS --max-tokens $TOKENS \
  --served-variant "$DEVICE=--device $DEVICE" --served-variant "$DEVICE-no-bi=--device $DEVICE --no-batch-invariant" \
  --no-invariant-off --no-write 2>&1 | grep -v " INFO "
for f in out/throughput-serve-*.log; do echo "--- $f"; grep -iE "error|warn|Traceback|KV cache|loaded" "$f" | head -8; done

step "decode step time in-process (build input + forward + sample, synchronized), batch-invariant on / off"
timeout 40 $PY benchmarks/step_time.py --model $M --device $DEVICE --rows 1,16,64 --steps 20 2>&1 | grep "^|"
timeout 40 $PY benchmarks/step_time.py --model $M --device $DEVICE --rows 1,16,64 --steps 20 --no-batch-invariant 2>&1 | grep "^|"
nvidia-smi --query-gpu=memory.used,clocks.sm --format=csv

step "pytest: the bfloat16-cuda param of tests/test_model_parity.py (transformers on the CPU as reference)"
SHEPHERD_TEST_MODEL=$M timeout 60 $PY -m pytest -q -p no:cacheprovider tests/test_model_parity.py -k cuda 2>&1 | tail -15
step "done"
