#!/usr/bin/env bash
# Issue 27's GPU session: the CPU kernel on FP8 experts, then bench-gpu's FP8 arms on the learned trace
# beside the bf16 fast mode, as background jobs on one warm device machine (they outlive a `run` call;
# files under /tmp carry over while the machine stays warm), polled by short calls:
#
#   bash scripts/gpu_fp8_session.sh kernel          # call 1 (no vLLM needed): the kernel bench, ~1 min, in the background
#   ... staging calls (../shared/gpu/README.md, .stage/pK) ...
#   source /tmp/stage/setup_on_device.sh && bash scripts/gpu_fp8_session.sh bench   # last staging call: the arms, ~12 min
#   bash scripts/gpu_fp8_session.sh poll $OUT 540   # until done (or the wait), then copies the results to $OUT
#   source /tmp/stage/setup_on_device.sh && ARMS=... bash scripts/gpu_fp8_session.sh finish $OUT   # out of time: stop, join what finished
#
# Results to commit: $OUT/cpu_kernel_fp8.json, $OUT/bench_gpu_fp8.{json,md} (ARMS, QUANT override).
set -u
PHASE=${1:?phase: kernel, bench or poll}
R=$PWD
export PYTHONUNBUFFERED=1
W=/tmp/fp8; mkdir -p $W
case $PHASE in
kernel)
  (setsid nohup bash -c "source $R/scripts/device_shim.sh; cd /tmp && python3 -m reap_swap.server_ext.cpu_experts.bench_cpu_kernel \
      --out $W/cpu_kernel_fp8.json --label 'device host, GPU idle, staging copies beside it' --backends native \
      --weights bf16,fp8,fp8-block --cpus 2-15 --experts 64 --reps 5; echo kernel-done" > $W/kernel.log 2>&1 &)
  echo started ;;
bench)
  # the vLLM environment of the caller (setup_on_device.sh) is inherited by the background job
  (setsid nohup bash -c "cd $R && QUANT=${QUANT:-fp8} ARMS=${ARMS:-stock_gpu,stock_offload,reap_static,reap_cache,reap_fast,bf16_reap_fast} \
      WORKDIR=fp8 RESULT=bench_gpu_fp8 DEADLINE=${DEADLINE:-1500} bash scripts/gpu_learned_session.sh bench $W/out; echo bench-done" \
      > $W/session.log 2>&1 &)
  echo started ;;
poll)
  OUT=${2:?output dir}; WAIT=${3:-540}
  t=0
  while [ $t -lt $WAIT ] && ! grep -q bench-done $W/session.log 2>/dev/null; do sleep 10; t=$((t + 10)); done
  mkdir -p $OUT
  cp $W/cpu_kernel_fp8.json $W/kernel.log $OUT/ 2>/dev/null
  cp $W/out/* $OUT/ 2>/dev/null
  cp /tmp/learned/fp8/*.json $OUT/ 2>/dev/null  # each finished arm's raw JSON
  tail -c 1500 $W/kernel.log 2>/dev/null; echo; grep -a "bench-gpu: arm" /tmp/learned/bench.log 2>/dev/null | tail -8
  tail -c 2500 $W/session.log 2>/dev/null ;;
finish)
  # the device time is running out: stop the arm in flight, join the finished arms into $OUT (nothing new runs)
  OUT=${2:?output dir}
  pkill -f "gpu_learned_session.sh bench" ; pkill -f "reap_swap.cli" ; pkill -f "benchmarks.learned.arm"; sleep 3
  (cd $R && QUANT=${QUANT:-fp8} ARMS=${ARMS:-stock_gpu,stock_offload,reap_static,reap_cache,reap_fast,bf16_reap_fast} \
      WORKDIR=fp8 RESULT=bench_gpu_fp8 DEADLINE=1 bash scripts/gpu_learned_session.sh bench $OUT > $W/join.log 2>&1)
  mkdir -p $OUT; cp $W/cpu_kernel_fp8.json $W/kernel.log $OUT/ 2>/dev/null; cp /tmp/learned/fp8/*.json $OUT/ 2>/dev/null
  tail -c 2000 $W/join.log ;;
*) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
