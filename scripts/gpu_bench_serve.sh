#!/usr/bin/env bash
# The served load benchmark on the GPU machine (reap-swap bench-serve): stock `vllm serve --cpu-offload-gb`
# against `reap-swap serve` with the online cache and the fast mode, at concurrency 1, 8 and 32, on the
# Qwen3-30B-A3B expert shape (24 layers, dummy weights from the config) with the learned trace
# replayed inside every server's worker. 38 of 128 experts per layer sit in the reap slots, and
# stock offload's --cpu-offload-gb (18.98 GiB) leaves the same 30 % of expert bytes on the GPU.
#
# One device `run` call per invocation, vLLM staged first (../shared/gpu/README.md; parts 1..N-1
# copy, the last sources setup_on_device.sh). Each call runs the arms that fit DEADLINE (an arm
# starts only if the slowest finished arm of its kind would fit) and writes the joined result:
#
#   source /tmp/stage/setup_on_device.sh && bash scripts/gpu_bench_serve.sh $OUT   # stock_offload (~6-7 min)
#   source /tmp/stage/setup_on_device.sh && bash scripts/gpu_bench_serve.sh $OUT   # reap arms (~3-4 min each)
#   DRY_RUN=1 bash scripts/gpu_bench_serve.sh /tmp/x                                # command lines only (any machine)
#
# --resume reads the previous result from /tmp/bench_serve (same warm machine) or, on a bare one,
# from benchmarks/results/bench_serve_<tag>.json in the working tree: copy $OUT/bench_serve_<tag>.json
# there between calls. ARMS, CONC, DEADLINE (s, default 540) and START_TIMEOUT (s, default 360)
# override the defaults. Results to commit: $OUT/bench_serve_<tag>.{json,md} (tag: the card, e.g. h100).
set -u
OUT=${1:?output dir}
R=$PWD
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
source $R/scripts/device_shim.sh
W=/tmp/bench_serve; mkdir -p $W $OUT
# the tag and the file name say which card ran it (h100, h200; TAG overrides)
TAG=${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i 'H[0-9][0-9]*' | head -1 | tr 'A-Z' 'a-z')}
TAG=${TAG:-gpu}
RESULT=$W/bench_serve_$TAG.json
[ -f $RESULT ] || [ ! -f $R/benchmarks/results/bench_serve_$TAG.json ] || cp $R/benchmarks/results/bench_serve_$TAG.json $RESULT
A=(--shape 30b-a3b-24l --device cuda --arms ${ARMS:-stock_offload,reap_cache,reap_fast} --concurrency ${CONC:-1,8,32}
   --repeats 3 --requests-per-stream 3 --min-requests 8 --max-tokens 64
   --trace $R/benchmarks/traces/learned128_t0.8.npz --sets $R/benchmarks/results/learned_sets.json
   --start-timeout-s ${START_TIMEOUT:-360} --tag $TAG --workdir $W/work --out $RESULT --resume --deadline-s ${DEADLINE:-540})
if [ -n "${DRY_RUN:-}" ]; then
  rs bench-serve "${A[@]}" --dry-run
  exit $?
fi
rs bench-serve "${A[@]}" > $W/bench.log 2>&1; rc=$?
echo "bench-serve rc=$rc"
cp $RESULT ${RESULT%.json}.md $OUT/ 2>/dev/null
mkdir -p $OUT/logs && cp $W/work/logs/*.log $OUT/logs/ 2>/dev/null
for f in $OUT/logs/*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$f.tail" && mv "$f.tail" "$f"; done
tail -c 4000 $W/bench.log
exit $rc
