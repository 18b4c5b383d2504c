#!/usr/bin/env bash
# Issue 26, deliverable 1: time to first token at 2K, 8K and 32K prompt tokens, stock offload vs reap-swap
# without and with prefill staging, on the 40K-position 30B-A3B shape. One bench-gpu call times every
# length inside each arm's one engine (three engine builds, not nine). vLLM must be staged first
# (../shared/gpu/README.md); run from the repo root on the GPU machine, e.g. with the last stage part:
#
#   DEADLINE=540 bash scripts/gpu_prefill_session.sh $OUT   # as many arms as fit before the deadline
#   bash scripts/gpu_prefill_session.sh $OUT                # again: --resume reuses finished arms
#
# Every call writes $OUT/bench_prefill_h200.{json,md} with the arms finished so far (prompt_lens,
# arms.<arm>.ttft_ms_p<N>, ratios.ttft_*_p<N>, acceptance: TTFT at 8K <= 0.8x stock offload's, at
# 32K <= 2.5 s) and $OUT/arms.log. GEN (default 16) is the tokens decoded per timed run: TTFT is
# the figure here, so the decode runs are kept short. LENS, ARMS and WORKDIR (under /tmp/prefill) override.
set -u
OUT=${1:?output dir}
R=$PWD
export PYTHONUNBUFFERED=1
source $R/scripts/device_shim.sh
W=/tmp/prefill; mkdir -p $W $OUT

ARMS=${ARMS:-stock_offload,reap_30,reap_30_stage}
A="--shape 30b-a3b-24l-40k --arms $ARMS --ttft-only --prompt-len ${LENS:-2048,8192,32768} --gen ${GEN:-16}"
A="$A --no-sweep --profile-steps 0 --workdir $W/${WORKDIR:-bench} --resume"
# vLLM's own max_num_batched_tokens (16384 for LLM() on an H100/H200): a 32K prompt prefills in two chunks
rs bench-gpu $A --deadline-s ${DEADLINE:-560} --out $OUT/bench_prefill_h200.json > $W/bench.log 2>&1
echo "bench-gpu exit $?"
cp $W/${WORKDIR:-bench}/arms.log $OUT/arms.log 2>/dev/null
tail -c 3000 $W/bench.log
