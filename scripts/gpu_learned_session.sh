#!/usr/bin/env bash
# The learned-routing GPU session (issues 15 and 10), one phase per device `run` call, back to back
# on one warm H200 (files under /tmp carry over between the calls; an idle machine is given back
# after ~30 s and starts bare). vLLM must be staged first (../shared/gpu/README.md: parts 1..3 copy,
# the last part sources setup_on_device.sh), e.g. part 4 + phase `retrain` in one call.
#
#   bash scripts/gpu_learned_session.sh retrain $OUT   # optional, ~7 min, no vLLM needed: retrain learned128,
#                                                      # record stratified traces, observe, learned-sets
#   bash scripts/gpu_learned_session.sh bench1 $OUT    # stock_gpu, stock_offload, reap_static (~8 min)
#   bash scripts/gpu_learned_session.sh bench2 $OUT    # reap_plan, reap_classifier, reap_cache (--resume)
#
# Without `retrain` the committed traces and sets are used (benchmarks/traces/learned128_t0.8.npz,
# benchmarks/results/learned_sets.json). Results to commit: $OUT/bench_gpu_learned.{json,md},
# $OUT/bench_gpu_cache.json and, after `retrain`, the new traces, sets and card data.
set -u
PHASE=${1:?phase: retrain, bench1 or bench2}
OUT=${2:?output dir}
R=$PWD
export PYTHONUNBUFFERED=1
source $R/scripts/device_shim.sh
W=/tmp/learned; mkdir -p $W $OUT
rs() { (cd /tmp && python3 -c "import sys; from reap_swap.cli import main; sys.exit(main())" "$@"); }

case $PHASE in
retrain)
  # model in /tmp/learned128, observation in /tmp/obs128, traces (domains taken in turn) in train_out
  SIBLING=0 bash $R/scripts/gpu_train_learned.sh $W/train_out
  cp $W/train_out/learned128_t0.8.npz $W/train_out/learned128_t0.npz $W/
  timeout 240 rs learned-sets --obs /tmp/obs128 --trace $W/learned128_t0.8.npz $W/learned128_t0.npz --model /tmp/learned128 \
    --corpus $R/example/realistic/test.jsonl $R/example/corpus/test.jsonl --slots-fraction 0.3 --workdir $W/sets \
    --out $W/learned_sets.json > $W/sets.log 2>&1
  cp $W/learned128_t0.8.npz $W/learned128_t0.npz $W/learned_sets.json $OUT/ 2>/dev/null
  cp $W/train_out/card_and_logs.tar.xz $OUT/; cp $W/sets.log $OUT/
  ls -la $OUT ;;
bench1|bench2)
  TRACE=$R/benchmarks/traces/learned128_t0.8.npz; SETS=$R/benchmarks/results/learned_sets.json
  [ -f $W/learned128_t0.8.npz ] && [ -f $W/learned_sets.json ] && TRACE=$W/learned128_t0.8.npz SETS=$W/learned_sets.json
  A="--trace $TRACE --sets $SETS --workdir $W/bench --deadline-s 560"
  if [ $PHASE = bench1 ]; then
    rs bench-gpu $A --arms stock_gpu,stock_offload,reap_static --out $OUT/part1.json
  else
    rs bench-gpu $A --resume --out $OUT/bench_gpu_learned.json
  fi
  tail -c 3000 $W/bench/arms.log ;;
*) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
