#!/usr/bin/env bash
# device step 0 (untracked, background from call 1, run in /tmp/rb): host bus check, CPU kernel tests on this host's ISA
R=/tmp/rb; cd $R
mkdir -p /tmp/res/k
lscpu > /tmp/res/lscpu.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > /tmp/res/gpu.txt 2>&1
bash scripts/gpu_learned_session.sh bus /tmp/res/bus > /tmp/res/bus.out 2>&1
source scripts/device_shim.sh
mkdir -p /tmp/kt && cp $R/tests/test_cpu_experts_fp8.py $R/tests/test_cpu_experts.py /tmp/kt/
(cd /tmp/kt && timeout 400 env PYTHONPATH=$R/devtools/pyt:$PYTHONPATH python3 -m pytest -q -rs -p no:cacheprovider --rootdir /tmp/kt -c /dev/null \
  test_cpu_experts_fp8.py test_cpu_experts.py > /tmp/res/k/kernel_tests.log 2>&1; echo "rc=$?" >> /tmp/res/k/kernel_tests.log)
touch /tmp/res/k/STEP0_DONE
