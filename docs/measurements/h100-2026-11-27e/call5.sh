#!/usr/bin/env bash
# GPU call (2026-11-27 session 4, second): fa2-split's tiles swept at 8K, its best at 32K beside cuDNN.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
git log -1 --format='commit %h %s' > $OUT/log.txt 2>&1
B="python3 scripts/bench_gpu.py"
run() { local name=$1 limit=$2; shift 2; echo "== $name $(date +%T)" >> $OUT/log.txt; timeout $limit $B "$@" --json > $OUT/$name.json 2> $OUT/$name.jsonl; echo "rc=$? $(date +%T)" >> $OUT/log.txt; }
run tiles-8k 125 kernels --kernel-lens 8192 --head-dims 128 --kernels packed-fa2-split --fa2-tiles 64x64,4,3 --fa2-tiles 64x64,8,2 --fa2-tiles 128x64,8,2 --fa2-tiles 64x128,4,2 --fa2-tiles 32x64,4,2
run tiles-32k 110 kernels --kernel-lens 32768 --head-dims 128 --kernels packed-fa2-split,cudnn --fa2-tiles 64x64,4,2
