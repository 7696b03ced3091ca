#!/usr/bin/env bash
# GPU call (2026-11-27 session 3, second): the unrolled layer loop at 2K rows, 32K under dots, 8B width.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
B="python3 scripts/bench_gpu.py"
run() { local name=$1 limit=$2; shift 2; echo "== $name $(date +%T)" >> $OUT/log.txt; timeout $limit $B "$@" --json > $OUT/$name.json 2>> $OUT/log.txt; echo "rc=$? $(date +%T)" >> $OUT/log.txt; }
run mfu-1b-2k-unroll 90 mfu --batch-tokens 8192 --seq-lens 2048 --scan-unroll 16 --trace
run mfu-1b-32k-dots-unroll 110 mfu --batch-tokens 32768 --seq-lens 32768 --remat dots --scan-unroll 16 --trace
run mfu-8b-8k-unroll 60 mfu --model 8b-width-4 --batch-tokens 8192 --seq-lens 8192 --scan-unroll 4 --trace
ls -la $OUT
