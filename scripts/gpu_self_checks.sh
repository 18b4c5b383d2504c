#!/usr/bin/env bash
# The CUDA self-checks (no vLLM): the code that only runs on CUDA -- the VMM bank, the Triton
# remap/capture and accounting kernels, the online cache's fused step, the CPU path's split/merge
# kernels and mapped staging -- against the CPU references; then the VMM release on failed
# allocations and the CPU path's wait timeout (recomputed over the link, eager and in a graph).
# One device `run` call: bash scripts/gpu_self_checks.sh $OUT  (one file back: self_checks.tgz)
set -u
OUT=${1:?output dir}
R=$PWD
export PYTHONUNBUFFERED=1
source $R/scripts/device_shim.sh
W=/tmp/self_checks; rm -rf $W; mkdir -p $W $OUT
export REAP_CPU_EXPERT_CPUS=${REAP_CPU_EXPERT_CPUS:-2-$(( $(nproc) - 1 ))}
run() { local name=$1 limit=$2; shift 2
  (cd /tmp && timeout $limit python3 "$@") > $W/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc"; echo "$name $rc" >> $W/rc.txt; }
run vmm 120 $R/scripts/gpu_vmm_check.py --out $W/vmm_check.json
run routing 120 $R/scripts/gpu_routing_check.py
run online_cache 150 $R/scripts/gpu_online_cache_check.py --steps 200
run cpu_path 300 $R/scripts/gpu_cpu_path_check.py $W/cpu_path_check.json  # T = 1, 8 and the budgeted 16, 32 (issue 26)
run vmm_release 150 $R/scripts/gpu_vmm_release_check.py $W/vmm_release_check.json --iters 40
run cpu_timeout 200 $R/scripts/gpu_cpu_timeout_check.py $W/cpu_timeout_check.json
run prefill 300 $R/scripts/gpu_prefill_check.py --out $W/prefill_check.json  # staging shared by layers; 2K/8K/32K staged vs UVA (issue 26)
tar -C $W -czf $OUT/self_checks.tgz .   # one file back: logs (each check's JSON) and rc.txt
cat $W/rc.txt
