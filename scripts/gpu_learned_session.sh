#!/usr/bin/env bash
# The learned-routing GPU session (issues 15, 10 and 13), one phase per device `run` call, back to back
# on one warm H200 (files under /tmp carry over between the calls; an idle machine is given back
# after ~30 s and starts bare). vLLM must be staged first (../shared/gpu/README.md; with this tree
# the 40 MiB parts no longer fit a call: `bash scripts/restage.sh` re-splits them into .stage/p1..pN;
# parts 1..N-1 copy, the last sources setup_on_device.sh), e.g. part N + phase `retrain` in one call.
#
#   bash scripts/gpu_learned_session.sh retrain $OUT   # optional, ~7 min, no vLLM needed: retrain learned128,
#                                                      # record stratified traces, observe, learned-sets
#   DEADLINE=420 bash scripts/gpu_learned_session.sh bench $OUT   # as many arms as fit, in priority order
#   bash scripts/gpu_learned_session.sh bench $OUT                # again: --resume skips finished arms
#   V2=1 WORKDIR=bench_v2 RESULT=bench_gpu_learned_v2 bash scripts/gpu_learned_session.sh bench $OUT  # v2's trace
#   V2=1 ALSO_V1=1 ... bench $OUT   # each arm runs v2's workload, then v1's on the same engine (RESULT_ALSO names v1's JSON)
#   EXTRA=32 ARMS=stock_gpu,stock_offload,reap_cache,reap_static_cpu,reap_fast V2=1 ALSO_V1=1 WORKDIR=bs32 \
#     RESULT=bench_gpu_fast_v2 RESULT_ALSO=bench_gpu_fast bash scripts/gpu_learned_session.sh bench $OUT   # issue 25's batch 32
#   QUANT=fp8 ARMS=stock_gpu,stock_offload,reap_static,reap_cache,reap_fast,bf16_reap_fast WORKDIR=fp8 \
#     RESULT=bench_gpu_fp8 bash scripts/gpu_learned_session.sh bench $OUT   # issue 27: FP8 arms + the bf16 fast baseline
#   QUANT=w4a16 ARMS=stock_gpu,reap_cache,stock_offload,reap_static WORKDIR=w4 RESULT=bench_gpu_w4a16 \
#     bash scripts/gpu_learned_session.sh bench $OUT   # issue 27's 4-bit arm (link path only: no CPU-path arms)
#   bash scripts/gpu_learned_session.sh bus $OUT   # ~1 min, no vLLM: the host's shared DRAM ceiling (CPU kernel alone, link
#                                                  # alone, both at once) into $OUT/host_bus.json, for the clock of arms run on this host
#
# ARMS (comma-separated, stock_gpu first), WORKDIR (under /tmp/learned) and RESULT (the joined JSON's
# name) override the defaults, e.g. for a follow-up run of a few arms beside the full table.
# Every call passes --resume with stock_gpu first (its output ids, reused from the workdir, are the
# reference), and starts an arm only when the slowest arm so far would fit before the deadline; each
# call writes the joined result of every arm finished so far.
# Without `retrain` the committed traces and sets are used (benchmarks/traces/learned128_t0.8.npz,
# benchmarks/results/learned_sets.json). Results to commit: $OUT/bench_gpu_learned.{json,md},
# $OUT/bench_gpu_cache.json and, after `retrain`, the new traces, sets and card data.
set -u
PHASE=${1:?phase: retrain, bench or bus}
OUT=${2:?output dir}
R=$PWD
export PYTHONUNBUFFERED=1
source $R/scripts/device_shim.sh
W=/tmp/learned; mkdir -p $W $OUT

case $PHASE in
retrain)
  # model in /tmp/learned128, observation in /tmp/obs128, traces (domains taken in turn) in train_out
  SIBLING=0 bash $R/scripts/gpu_train_learned.sh $W/train_out
  cp $W/train_out/learned128_t0.8.npz $W/train_out/learned128_t0.npz $W/
  timeout 240 rs learned-sets --obs /tmp/obs128 --trace $W/learned128_t0.8.npz $W/learned128_t0.npz --model /tmp/learned128 \
    --corpus $R/example/realistic/test.jsonl $R/example/corpus/test.jsonl --slots-fraction 0.3 --extra-batches 32 --workdir $W/sets \
    --out $W/learned_sets.json > $W/sets.log 2>&1
  cp $W/learned128_t0.8.npz $W/learned128_t0.npz $W/learned_sets.json $OUT/ 2>/dev/null
  cp $W/train_out/card_and_logs.tar.xz $OUT/; cp $W/sets.log $OUT/
  ls -la $OUT ;;
bench)
  TRACE=$R/benchmarks/traces/learned128_t0.8.npz; SETS=$R/benchmarks/results/learned_sets.json
  [ -f $W/learned128_t0.8.npz ] && [ -f $W/learned_sets.json ] && TRACE=$W/learned128_t0.8.npz SETS=$W/learned_sets.json
  # V2=1: learned128 v2's committed trace and sets (issue 24; with WORKDIR=bench_v2 RESULT=bench_gpu_learned_v2)
  [ "${V2:-0}" = 1 ] && TRACE=$R/benchmarks/traces/learned128_v2_t0.8.npz SETS=$R/benchmarks/results/learned_sets_v2.json
  # EXTRA=32: more batch sizes timed like bs8 (bench-gpu --extra-batches); the classifier arms need the sets' classifier_bs32:
  # those `retrain` makes (learned-sets --extra-batches 32), not the committed files nor ALSO_V1's
  # QUANT=fp8, fp8-block or w4a16: every arm's experts quantized (bench-gpu --quantization) but bf16_reap_fast's
  A="--trace $TRACE --sets $SETS --workdir $W/${WORKDIR:-bench} --resume${EXTRA:+ --extra-batches $EXTRA}${QUANT:+ --quantization $QUANT}"
  # ALSO_V1=1 (with V2=1): every arm also runs v1's trace and sets on the same engine after v2's workload
  # (bench-gpu --also-trace: one engine build, two workloads, v1 beside v2 in one run), result RESULT_ALSO
  also() { [ "${ALSO_V1:-0}" = 1 ] && echo "--also-trace $R/benchmarks/traces/learned128_t0.8.npz --also-sets $R/benchmarks/results/learned_sets.json --also-out $1"; }
  ARMS=${ARMS:-stock_gpu,stock_offload,reap_cache,reap_static,reap_classifier,reap_plan,reap_classifier_complement,reap_cache_complement}
  rs bench-gpu $A $(also $W/part_also.json) --arms $ARMS --deadline-s ${DEADLINE:-560} --out $W/part.json > $W/bench.log 2>&1
  # the joined table in the standard arm order (nothing new runs: all reused or marked not run)
  rs bench-gpu $A $(also $OUT/${RESULT_ALSO:-bench_gpu_learned_v1_beside_v2}.json) --arms $ARMS --deadline-s 1 \
    --out $OUT/${RESULT:-bench_gpu_learned}.json > $W/join.log 2>&1
  cp $W/${WORKDIR:-bench}/arms.log $OUT/arms.log 2>/dev/null
  tail -c 2500 $W/bench.log; tail -c 1500 $W/join.log ;;
bus)
  # the clock's host_dram_GBps (planning/step_time.py) on the host the arms ran on: both pipes read one DRAM
  (cd /tmp && timeout 150 python3 $R/scripts/gpu_host_bus_check.py $OUT/host_bus.json > $W/bus.log 2>&1); echo "bus rc=$?"
  tail -c 1500 $W/bus.log ;;
*) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
