#!/usr/bin/env bash
# device step 0 (untracked, background from call 1, run in /tmp/rb): bus check, FP8 kernel tests, kernel bench old vs new
R=/tmp/rb; cd $R
mkdir -p /tmp/res/k
bash scripts/gpu_learned_session.sh bus /tmp/res/bus > /tmp/res/bus.out 2>&1
source scripts/device_shim.sh
mkdir -p /tmp/fp8t && cp $R/tests/test_cpu_experts_fp8.py /tmp/fp8t/
(cd /tmp/fp8t && timeout 300 env PYTHONPATH=$R/devtools/pyt:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider --rootdir /tmp/fp8t -c /dev/null test_cpu_experts_fp8.py > /tmp/res/k/fp8_tests.log 2>&1; echo "rc=$?" >> /tmp/res/k/fp8_tests.log)
rm -rf /tmp/rb_old && mkdir -p /tmp/rb_old && (cd $R && tar -cf - server_ext scripts reap_swap planning models proxy classifier example benchmarks pyproject.toml) | tar -xf - -C /tmp/rb_old
cp $R/devtools/native_experts_old.c /tmp/rb_old/server_ext/cpu_experts/native_experts.c
lscpu > /tmp/res/k/lscpu.txt
bench() { # $1 tree, $2 tag
  (export R=$1 REAP_SHIM_DIR=/tmp/shim_$2; source $1/scripts/device_shim.sh; cd /tmp && timeout 240 python3 -m reap_swap.server_ext.cpu_experts.bench_cpu_kernel \
    --out /tmp/res/k/cpu_kernel_fp8_$2.json --label "device host, GPU idle, staging beside it: kernel $2" --backends native \
    --weights bf16,fp8,fp8-block --cpus 2-$(( $(nproc) - 1 )) --experts 64 --reps 5 > /tmp/res/k/bench_$2.log 2>&1; echo "$2 rc=$?" >> /tmp/res/k/rc.txt)
}
bench /tmp/rb_old old; bench /tmp/rb new
touch /tmp/res/k/STEP0_DONE
