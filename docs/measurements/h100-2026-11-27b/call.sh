#!/usr/bin/env bash
# GPU call 1 (2026-11-27 session 2): where the 1B step's time goes, 32K steps, 8B-width steps.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/gpu.txt 2>&1
B="python3 scripts/bench_gpu.py mfu --json"
run() { local name=$1 limit=$2; shift 2; echo "== $name $(date +%T)" | tee -a $OUT/log.txt; timeout $limit $B "$@" > $OUT/$name.json 2>> $OUT/log.txt; echo "rc=$? $(date +%T)" | tee -a $OUT/log.txt; }
run mfu-1b-trace 120 --batch-tokens 8192 --trace
run mfu-1b-32k-none 100 --batch-tokens 32768 --seq-lens 32768 --trace
run mfu-1b-32k-dots 80 --batch-tokens 32768 --seq-lens 32768 --remat dots
run mfu-8b-8k 70 --model 8b-width-4 --batch-tokens 8192 --seq-lens 8192 --trace
run mfu-8b-32k-full 80 --model 8b-width-4 --batch-tokens 32768 --seq-lens 32768 --remat full
ls -la $OUT
