#!/usr/bin/env bash
# The CPU expert path's GPU session (issue 16), one phase per device `run` call, back to back on one
# warm H200 (files under /tmp carry over; an idle machine is given back after ~30 s and starts bare).
#
#   bash scripts/gpu_cpu_misses_session.sh check $OUT    # no vLLM needed: VMM host rows readable by the CPU,
#                                                        # eager + graph-captured layer steps vs reference, chained
#                                                        # 24-layer step cost, CPU kernel GB/s, memcpy
#   bash scripts/gpu_cpu_misses_session.sh exact $OUT    # (vLLM staged) stock vs CPU path, 256 greedy tokens (EXACT_MODELS picks),
#                                                        # small_moe and learned128_cpu: agreement, max |delta logit|
#   bash scripts/gpu_cpu_misses_session.sh dummy $OUT    # bench-gpu: stock_offload, reap_30, reap_30_cpu (dummy routing)
#   bash scripts/gpu_cpu_misses_session.sh learned $OUT  # bench-gpu --trace: reap_static, reap_static_cpu
#
# Every bench phase passes --resume (a later call skips finished arms). REAP_CPU_EXPERT_CPUS defaults to
# every core but the first two (benchmarks/cpu_misses.py). Then, on the CPU box:
#   python -m reap_swap.benchmarks.cpu_misses assemble --dummy bench_gpu_cpu_dummy.json \
#     --learned bench_gpu_learned_cpu.json --check cpu_path_check.json --exactness cpu_exactness.json
set -u
PHASE=${1:?phase: check, exact, dummy or learned}
OUT=${2:?output dir}
R=$PWD
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
source $R/scripts/device_shim.sh
W=/tmp/cpum; mkdir -p $W $OUT
py() { (cd /tmp && python3 "$@"); }
case $PHASE in
check)
  export REAP_CPU_EXPERT_CPUS=${REAP_CPU_EXPERT_CPUS:-2-$(( $(nproc) - 1 ))}
  (cd /tmp && timeout 200 python3 $R/scripts/gpu_cpu_path_check.py $OUT/cpu_path_check.json) > $OUT/check.log 2>&1; echo "check rc=$?"
  tail -c 4000 $OUT/check.log ;;
exact)
  (cd /tmp && timeout ${EXACT_TIMEOUT:-420} python3 -m reap_swap.benchmarks.cpu_exactness run --out $OUT/cpu_exactness.json --workdir $W/exact ${EXACT_MODELS:+--models $EXACT_MODELS}) \
    > $OUT/exact.log 2>&1; echo "exact rc=$?"
  tail -c 3000 $OUT/exact.log; tail -c 3000 $W/exact/arms.log ;;
dummy)
  rs bench-gpu --arms ${ARMS:-stock_offload,reap_30,reap_30_cpu} --no-sweep --workdir $W/dummy --resume \
    --deadline-s ${DEADLINE:-540} --out $OUT/bench_gpu_cpu_dummy.json > $W/dummy.log 2>&1; echo "dummy rc=$?"
  cp $W/dummy/arms.log $OUT/dummy_arms.log 2>/dev/null; tail -c 3000 $W/dummy.log ;;
learned)
  rs bench-gpu --trace $R/benchmarks/traces/learned128_t0.8.npz --sets $R/benchmarks/results/learned_sets.json \
    --arms ${ARMS:-reap_static,reap_static_cpu} --workdir $W/learned --resume --deadline-s ${DEADLINE:-540} \
    --out $OUT/bench_gpu_learned_cpu.json > $W/learned.log 2>&1; echo "learned rc=$?"
  cp $W/learned/arms.log $OUT/learned_arms.log 2>/dev/null; tail -c 3000 $W/learned.log ;;
*) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
