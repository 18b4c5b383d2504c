#!/usr/bin/env bash
# replaces chain_gpu.sh after its FP8 bench: clean kernel benches old/new, then a v1 fast subset (untracked)
cd /tmp/repo; B=$1; T0=$(date +%s)
source /tmp/stage/setup_on_device.sh > /dev/null
left() { echo $(( B - ($(date +%s) - T0) )); }
log() { echo "[chain2 $(( $(date +%s) - T0 ))s] $*" >> /tmp/res/chain.log; }
log "waiting for the FP8 bench, left $(left)"
while pgrep -f "gpu_learned_session.sh bench" > /dev/null; do sleep 2; done
cp /tmp/learned/fp8all/*.json /tmp/res/fp8/ 2>/dev/null
log "fp8 done, kernel benches, left $(left)"
bench() { # $1 tree, $2 tag
  (export R=$1 REAP_SHIM_DIR=/tmp/shim_$2; source $1/scripts/device_shim.sh; cd /tmp && timeout 240 python3 -m reap_swap.server_ext.cpu_experts.bench_cpu_kernel \
    --out /tmp/res/k/cpu_kernel_fp8_$2.json --label "H100 device host, GPU idle, nothing else running: kernel $2" --backends native \
    --weights bf16,fp8,fp8-block --cpus 2-$(( $(nproc) - 1 )) --experts 64 --reps 5 > /tmp/res/k/bench_$2.log 2>&1; echo "$2 rc=$?" >> /tmp/res/k/rc.txt)
}
bench /tmp/rb_old old2; bench /tmp/rb new2
log "fast v1 subset start, left $(left)"
ARMS=stock_gpu,reap_fast,reap_static_cpu WORKDIR=fastv1s RESULT=bench_gpu_fast_static_cpu DEADLINE=$(( $(left) - 25 )) \
  bash scripts/gpu_learned_session.sh bench /tmp/res/fastsub >> /tmp/res/chain.log 2>&1
cp /tmp/learned/fastv1s/*.json /tmp/res/fastsub/ 2>/dev/null
log "done, left $(left)"
touch /tmp/res/DONE
