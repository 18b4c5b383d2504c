#!/usr/bin/env bash
# this session's device chain (untracked): bash chain_gpu.sh BUDGET_S; results under /tmp/res
R=$PWD; B=$1; T0=$(date +%s)
source /tmp/stage/setup_on_device.sh > /dev/null
mkdir -p /tmp/res
left() { echo $(( B - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 ))s] $*" >> /tmp/res/chain.log; }
nvidia-smi --query-gpu=name,memory.total --format=csv > /tmp/res/gpu.txt 2>&1
lscpu > /tmp/res/lscpu.txt 2>&1
log "fp8-block start, left $(left)"
QUANT=fp8-block ARMS=stock_gpu,reap_fast,bf16_reap_fast,stock_offload WORKDIR=fp8c RESULT=bench_gpu_fp8 DEADLINE=$(( $(left) - 60 )) \
  bash scripts/gpu_learned_session.sh bench /tmp/res/fp8 >> /tmp/res/chain.log 2>&1
log "w4a16 start, left $(left)"
QUANT=w4a16 ARMS=stock_gpu,reap_cache,stock_offload,reap_static WORKDIR=w4 RESULT=bench_gpu_w4a16 DEADLINE=$(( $(left) - 60 )) \
  bash scripts/gpu_learned_session.sh bench /tmp/res/w4 >> /tmp/res/chain.log 2>&1
log "fast v2 start, left $(left)"
EXTRA=32 V2=1 ARMS=stock_gpu,reap_fast,reap_static_cpu,reap_cache,stock_offload WORKDIR=fastv2 RESULT=bench_gpu_fast_v2 DEADLINE=$(( $(left) - 40 )) \
  bash scripts/gpu_learned_session.sh bench /tmp/res/fast >> /tmp/res/chain.log 2>&1
log "done, left $(left)"
touch /tmp/res/DONE
