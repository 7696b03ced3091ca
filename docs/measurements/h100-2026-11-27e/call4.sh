#!/usr/bin/env bash
# GPU call (2026-11-27 session 4): fa2-split checked and timed at three tiles, the 32K kernel rows,
# the 1B step under XLA's latency-hiding scheduler.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/log.txt 2>&1
git log -1 --format='commit %h %s' >> $OUT/log.txt 2>&1
B="python3 scripts/bench_gpu.py"
run() { local name=$1 limit=$2; shift 2; echo "== $name $(date +%T)" >> $OUT/log.txt; timeout $limit $B "$@" --json > $OUT/$name.json 2> $OUT/$name.jsonl; echo "rc=$? $(date +%T)" >> $OUT/log.txt; }
run check 75 check
run kernels-8k 130 kernels --kernel-lens 8192 --head-dims 128 --kernels packed,packed-fa2-split --fa2-tiles 64x64,4,2 --fa2-tiles 32x128,4,2
run kernels-32k 150 kernels --kernel-lens 32768 --head-dims 128 --kernels packed,packed-fa2-split,ring-step,cudnn-packed,cudnn
XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true run mfu-1b-8k-lhs 100 mfu --batch-tokens 8192 --seq-lens 8192 --scan-unroll 16 --trace
ls -la $OUT
