#!/usr/bin/env bash
# Issue 29's two-GPU session: bench-gpu --tensor-parallel-size 2 on the learned trace, and the host bus
# with two CPU teams and two links at once. Needs the nvidia-h200-x2 kind (or nvidia-h100-x2); one phase
# per device `run` call, back to back on one warm machine (files under /tmp carry over; an idle machine
# is given back and starts bare). vLLM staged first (../shared/gpu/README.md; `bash scripts/restage.sh`
# re-splits the parts to fit a call beside the tree: parts 1..N-1 copy, the last sources setup_on_device.sh).
#
#   DEADLINE=420 bash scripts/gpu_tp2_session.sh bench $OUT   # the first call also pays the setup
#   bash scripts/gpu_tp2_session.sh bench $OUT                # again until every arm is in (--resume)
#   bash scripts/gpu_tp2_session.sh bus $OUT                  # per-pipe GB/s: one GPU + team, then two at once
#   DRY_RUN=1 bash scripts/gpu_tp2_session.sh bench /tmp/x    # the command lines only (any machine)
#
# bench: arms stock_gpu (TP=2, all on GPU: the ids' reference, first), stock_offload (TP=2, cpu_offload_gb
# per GPU = the one-GPU figure / 2: each GPU keeps the expert bytes of 38 slots of half-experts), reap_cache,
# reap_static_cpu, reap_fast; decode at batch 1 (8 trace requests), 8 (2 groups) and 32 (--extra-batches 32:
# the trace's one complete group of 32); the CPU path's teams get one core list per rank, after 2 cores per
# rank left to vLLM (benchmarks/tp.py; REAP_CPU_EXPERT_CPUS='a-b;c-d' overrides). Each call passes --resume
# with the same workdir and starts an arm only when the slowest finished arm would fit DEADLINE (s, default
# 540), then writes the joined result of every arm finished so far.
# bus: scripts/gpu_host_bus_check.py (CPU kernel alone, link alone, both) on GPU 0 with rank 0's cores
# alone, then on GPU 0 and GPU 1 at once with each rank's cores: each pipe's GB/s with the host's DRAM
# shared by two teams and two links (the two processes' phases start together and last ~1 s each).
# ARMS, WORKDIR (under /tmp/tp2) and RESULT override the defaults. Results to commit:
# $OUT/bench_gpu_tp2.{json,md} (+ bench_gpu_cache.json beside it) and $OUT/host_bus_tp2.json.
set -u
PHASE=${1:?phase: bench or bus}
OUT=${2:?output dir}
R=$PWD
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
[ -n "${DRY_RUN:-}" ] || source $R/scripts/device_shim.sh
W=/tmp/tp2; mkdir -p $W $OUT
exec 3>&1  # DRY_RUN prints the command lines here even where a command's output is redirected
run() { if [ -n "${DRY_RUN:-}" ]; then echo "$*" >&3; else "$@"; fi; }

case $PHASE in
bench)
  TRACE=$R/benchmarks/traces/learned128_t0.8.npz; SETS=$R/benchmarks/results/learned_sets.json
  ARMS=${ARMS:-stock_gpu,stock_offload,reap_cache,reap_static_cpu,reap_fast}
  A=(--tensor-parallel-size 2 --trace $TRACE --sets $SETS --arms $ARMS --batch 8 --extra-batches 32
     --workdir $W/${WORKDIR:-bench} --resume)
  if [ -n "${DRY_RUN:-}" ]; then
    echo "rs bench-gpu ${A[*]} --deadline-s ${DEADLINE:-540} --out $W/part.json"
    echo "rs bench-gpu ${A[*]} --deadline-s 1 --out $OUT/${RESULT:-bench_gpu_tp2}.json"
    exit 0
  fi
  nvidia-smi -L; nproc
  rs bench-gpu "${A[@]}" --deadline-s ${DEADLINE:-540} --out $W/part.json > $W/bench.log 2>&1; echo "bench rc=$?"
  # the joined table in the standard arm order (nothing new runs: all reused or marked not run)
  rs bench-gpu "${A[@]}" --deadline-s 1 --out $OUT/${RESULT:-bench_gpu_tp2}.json > $W/join.log 2>&1
  cp $W/${WORKDIR:-bench}/arms.log $OUT/arms.log 2>/dev/null
  [ -f $OUT/arms.log ] && tail -c 300000 $OUT/arms.log > $OUT/arms.tail && mv $OUT/arms.tail $OUT/arms.log
  tail -c 2500 $W/bench.log; tail -c 2500 $W/join.log ;;
bus)
  # rank 0's and rank 1's cores as bench-gpu gives them (benchmarks/tp.py: 2 per rank left to vLLM)
  CORES=$(cd /tmp && python3 -c "import os; from reap_swap.benchmarks import tp; print(tp.core_spec(tp.rank_core_lists(sorted(os.sched_getaffinity(0)), 2)))" 2>/dev/null)
  [ -n "$CORES" ] || CORES='RANK0_CORES;RANK1_CORES'  # DRY_RUN without the shim
  C0=${CORES%%;*}; C1=${CORES##*;}
  echo "rank cores: $C0 / $C1"
  cd /tmp
  run env CUDA_VISIBLE_DEVICES=0 REAP_CPU_EXPERT_CPUS=$C0 timeout 120 python3 $R/scripts/gpu_host_bus_check.py $OUT/host_bus_alone_gpu0.json > $W/bus0.log 2>&1
  echo "alone rc=$?"
  run env CUDA_VISIBLE_DEVICES=0 REAP_CPU_EXPERT_CPUS=$C0 timeout 120 python3 $R/scripts/gpu_host_bus_check.py $OUT/host_bus_pair_gpu0.json > $W/pair0.log 2>&1 &
  P0=$!
  run env CUDA_VISIBLE_DEVICES=1 REAP_CPU_EXPERT_CPUS=$C1 timeout 120 python3 $R/scripts/gpu_host_bus_check.py $OUT/host_bus_pair_gpu1.json > $W/pair1.log 2>&1
  echo "pair gpu1 rc=$?"; wait $P0; echo "pair gpu0 rc=$?"
  [ -n "${DRY_RUN:-}" ] && exit 0
  python3 - "$OUT" "$C0" "$C1" <<'EOF'
import json, sys
from pathlib import Path
out, c0, c1 = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
load = lambda n: json.loads((out / n).read_text()) if (out / n).is_file() else None
alone, p0, p1 = load("host_bus_alone_gpu0.json"), load("host_bus_pair_gpu0.json"), load("host_bus_pair_gpu1.json")
def pipes(r):
    if not r:
        return None
    return {"cpu_n8_GBps": r["cpu_alone"]["n8"]["GBps"], "link_GBps": r["link_alone"]["GBps"], "copy_GBps": r["copy_alone"]["GBps"],
            "cpu_n8_with_link": r.get("cpu_n8_with_link")}
res = {"what": "issue 29: per-pipe GB/s (CPU expert kernel, GPU reading host rows over its link, copy engine) with one GPU + team, "
               "and with two GPUs + two teams running the same phases at once (scripts/gpu_host_bus_check.py, one process per GPU, "
               "started together: their ~1 s phases line up to within the start-up difference, see each raw file's seconds)",
       "cores": {"rank0": c0, "rank1": c1}, "alone_gpu0": pipes(alone), "together": {"gpu0": pipes(p0), "gpu1": pipes(p1)},
       "raw": {"alone_gpu0": alone, "pair_gpu0": p0, "pair_gpu1": p1}}
(out / "host_bus_tp2.json").write_text(json.dumps(res, indent=1))
print(json.dumps({k: res[k] for k in ("cores", "alone_gpu0", "together")}, indent=1))
EOF
  tail -c 1500 $W/bus0.log ;;
*) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
