#!/usr/bin/env bash
# this session's device chain (untracked): bash chain_gpu.sh BUDGET_S; results under /tmp/res
R=$PWD; B=$1; T0=$(date +%s)
source /tmp/stage/setup_on_device.sh > /dev/null
mkdir -p /tmp/res
left() { echo $(( B - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 ))s] $*" >> /tmp/res/chain.log; }
log "waiting for step 0"
while [ ! -f /tmp/res/k/STEP0_DONE ] && pgrep -f step0.sh > /dev/null; do sleep 2; done
log "step 0 done: $(tail -2 /tmp/res/k/kernel_tests.log 2>&1 | tr '\n' ' ')"
log "fast v1 start, left $(left)"
EXTRA=32 ARMS=stock_gpu,reap_fast,reap_static_cpu,stock_offload,reap_cache WORKDIR=fastv1 RESULT=bench_gpu_fast DEADLINE=$(( $(left) - 45 )) \
  bash scripts/gpu_learned_session.sh bench /tmp/res/fast >> /tmp/res/chain.log 2>&1
cp /tmp/learned/fastv1/*.json /tmp/res/fast/ 2>/dev/null
log "done, left $(left)"
touch /tmp/res/DONE
