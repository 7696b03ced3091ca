#!/usr/bin/env bash
# GPU call (2026-11-27 session 3): the fused head, the unrolled layer loop, the ring's Pallas step, 32K under dots.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/log.txt 2>&1
git log -1 --format='commit %h %s' >> $OUT/log.txt 2>&1
B="python3 scripts/bench_gpu.py"
run() { local name=$1 limit=$2; shift 2; echo "== $name $(date +%T)" >> $OUT/log.txt; timeout $limit $B "$@" --json > $OUT/$name.json 2>> $OUT/log.txt; echo "rc=$? $(date +%T)" >> $OUT/log.txt; }
run check 60 check
run mfu-1b 100 mfu --batch-tokens 8192 --seq-lens 2048,8192 --trace
run mfu-1b-unroll 100 mfu --batch-tokens 8192 --seq-lens 8192 --scan-unroll 16 --trace
run kernels 110 kernels
run mfu-8b-8k 70 mfu --model 8b-width-4 --batch-tokens 8192 --seq-lens 8192 --trace
run mfu-1b-32k-dots 90 mfu --batch-tokens 32768 --seq-lens 32768 --remat dots --trace
grep -c . $OUT/log.txt; ls -la $OUT
