#!/usr/bin/env bash
# Issue 28: llama.cpp --n-cpu-moe and kt-kernel side by side with ours on the H200 machine.
#
#   bash scripts/gpu_peers.sh PHASES $OUT      # PHASES: comma list, run in order, of
#     build   llama.cpp (pinned 0c1e570, CUDA sm_90) -> llama-bench only, ninja -j16 (expect 4-8 min;
#             resumable: a rerun on the same warm machine continues the build)
#     gguf    the 30b-a3b-24l random bf16 GGUF (~29 GiB, streamed with the pinned gguf-py; < 1.5 min)
#             into /dev/shm/peers (or /tmp/peers when /dev/shm has < 32 GiB free)
#     bench   llama-bench -ngl 99 --n-cpu-moe 17, threads = our CPU team's cores: tg128 (batch 1),
#             pp256/512/2048, -r 3, -o json; then the all-experts-on-GPU run (--n-cpu-moe 0) (~2-3 min)
#     kt      kt-kernel 0.6.1's AMXBF16_MOE vs our native CPU kernel, same threads/cores, batch 1 and 8
#             (bench_cpu_kernel --kt; < 1.5 min); if it dies (SIGILL: AMX refused), once more with
#             KT_MOE_CLASS=AVX2BF16_MOE -> kt_vs_ours_avx2.json
#     ours    bench-gpu dummy-routing arms stock_offload,reap_30,reap_30_cpu,reap_30_fast (OURS_ARMS) on this machine:
#             decode at 256 prompt tokens, TTFT at 256 and 2048 (--ttft-only --prompt-len 256,2048), CPU team on
#             PEER_CPUS (~2.5-4 min an arm; resumable: a rerun on the same warm machine runs the arms left)
# Files under $OUT (at most 7 a call): peers.log, build.json, gguf.json, llamacpp_bench.json,
# llamacpp_bench.meta.json, llamacpp_all_gpu.json, kt_vs_ours.json (kt_vs_ours_avx2.json), bench_gpu_peers_ours.{json,md}.
#   bash scripts/gpu_peers.sh report DIR       # here, on the CPU box: DIR = the fetched $OUT files ->
#             benchmarks/results/peers_h200.json, or REPORT_OUT (benchmarks/peers.py; ours from the ours phase's bench_gpu_peers_ours.json)
#
# Device calls, back to back on one warm machine (/tmp and /dev/shm survive only while it stays warm,
# ~30 s idle), each carrying the two files (4.6 MiB together, made here first with
# scripts/peers_llamacpp_export.sh and the pip download in docs/benchmarks.md):
#   carry: [".peers/llama.cpp-0c1e570.tar.xz",
#           ".peers/kt_kernel-0.6.1-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"]
#   1. bash scripts/gpu_peers.sh kt,build $OUT            (timeout_s 600; ~1.5 + 4-8 min)
#   2. bash scripts/gpu_peers.sh gguf,bench $OUT          (timeout_s 600; ~1 + 2-3 min)
#   3. source /tmp/stage/setup_on_device.sh && bash scripts/gpu_peers.sh ours $OUT   (vLLM staged first; ~8 min)
# What ran on 2026-12-06 (H100 machine): `build` in the background (setsid) during vLLM's staging calls,
# with `gguf` beside it, then `bench,kt` (95 s), then `ours` (467 s).
# Each call stops its phases by DEADLINE_S (560 s) after its start; a build cut short goes on in a
# third call `build` (same warm machine), then `gguf,bench`.
# Later phases do what they need first if it is missing (bench builds and writes the GGUF), so a
# fresh machine still gets there, only slower. Knobs: PEER_CPUS (default 2-15: the cores
# REAP_CPU_EXPERT_CPUS gave the reap_30_cpu arm), N_CPU_MOE (17), REPS (3), ALL_GPU (1), JOBS (16),
# BUILD_TIMEOUT (500 s), KT_TASKSET (1: run the kt phase under taskset -c $PEER_CPUS); for a CPU dry
# run: PEER_DIR (/tmp/peers), GGUF (the model path), GGUF_ARGS (e.g. "--layers 2 --experts 16"),
# KT_ARGS (e.g. "--experts 16"), PEER_CUDA_SITE (more folders to look for the cuBLAS wheel in),
# PEER_CMAKE_ARGS (appended to the configure), KT_WHEEL (another kt-kernel wheel, e.g. cp311 here).
#
# Why --n-cpu-moe 17: the reap_30_cpu arm keeps 38 of 128 experts of each of the 24 layers on the
# GPU (29.7 % of the expert bytes); llama.cpp keeps whole layers' experts, so the GPU holding the
# same bytes is 0.297 * 24 = 7.1 layers -> 7 layers on the GPU (29.2 %), the experts of the first
# 17 layers on the CPU. Attention, norms, router and embeddings stay on the GPU in both (-ngl 99).
set -u
PHASES=${1:?phases: build,gguf,bench,kt (comma-separated) or report DIR}
OUT=${2:?output dir}
R=$(cd "$(dirname "$0")/.." && pwd)
SHORT=0c1e570
TARBALL=$R/.peers/llama.cpp-$SHORT.tar.xz
WHEEL=${KT_WHEEL:-$(ls "$R"/.peers/kt_kernel-0.6.1-cp312-*.whl 2>/dev/null | head -1)}
P=${PEER_DIR:-/tmp/peers}
SRC=$P/llama.cpp-$SHORT
BUILD=$SRC/build-cuda
BENCH=$BUILD/bin/llama-bench
CPUS=${PEER_CPUS:-2-15}
N_CPU_MOE=${N_CPU_MOE:-17}
export PYTHONUNBUFFERED=1
mkdir -p "$P" "$OUT"
LOG=$OUT/peers.log

if [ "$PHASES" = report ]; then
  D=$OUT
  cd /tmp && PYTHONPATH=${PYTHONPATH:-} python3 -m reap_swap.benchmarks.peers \
    --llamacpp "$D/llamacpp_bench.json" --llamacpp-all-gpu "$D/llamacpp_all_gpu.json" --kt "$D/kt_vs_ours.json" \
    --kt-fallback "$D/kt_vs_ours_avx2.json" \
    --ours-kernel "$R/benchmarks/results/cpu_kernel_h200.json" \
    --ours-gpu "${OURS_GPU:-$D/bench_gpu_peers_ours.json}" \
    --out "${REPORT_OUT:-$R/benchmarks/results/peers_h200.json}"
  exit $?
fi

# the core list -> thread count and llama.cpp's hex mask
read -r NT MASK < <(python3 -c "
import sys
cores=[]
for part in sys.argv[1].split(','):
    a,_,b=part.partition('-'); cores+=range(int(a),int(b or a)+1)
print(len(cores), hex(sum(1<<c for c in cores)))" "$CPUS")

# our package without installing it (see device_shim.sh); run python from /tmp
if [ -z "${PEER_NO_SHIM:-}" ] && [ -f "$R/scripts/device_shim.sh" ]; then R=$R source "$R/scripts/device_shim.sh"; fi
py() { (cd /tmp && python3 "$@"); }

if [ -z "${GGUF:-}" ]; then
  shm_free=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
  if [ "${shm_free:-0}" -ge 32 ]; then GGUF=/dev/shm/peers/30b-a3b-24l-bf16.gguf; else GGUF=$P/30b-a3b-24l-bf16.gguf; fi
fi

START=$(date +%s)
# seconds left of this call's budget (DEADLINE_S, default 560: a device call may run 600), capped at $1
left() { local l=$(( START + ${DEADLINE_S:-560} - $(date +%s) )); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 1 ] && l=1; echo "$l"; }
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
keep() { for f in "$@"; do [ -f "$P/$f" ] && cp "$P/$f" "$OUT/"; done; }  # earlier calls' summaries come back too

unpack() {
  [ -f "$SRC/PINNED_COMMIT" ] && return 0
  [ -f "$TARBALL" ] || { log "missing $TARBALL: carry it (scripts/peers_llamacpp_export.sh makes it)"; return 1; }
  tar xJf "$TARBALL" -C "$P" && log "unpacked $(cat "$SRC/PINNED_COMMIT")"
}

phase_build() {
  [ -x "$BENCH" ] && { log "build: $BENCH already there"; keep build.json; return 0; }
  unpack || return 1
  export GIT_CEILING_DIRECTORIES=$P  # the tree has no .git: never pick up the working tree's commit
  local nvcc t0 t1 t2 rc
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  t0=$(date +%s)
  if [ ! -f "$BUILD/build.ninja" ]; then
    # cuBLAS / libcuda outside the toolkit's folders (pip-wheel toolkits): scripts/peers_cuda_args.py
    local extra=()
    mapfile -t extra < <(python3 "$R/scripts/peers_cuda_args.py" "$nvcc" "$P/cublas_include" ${PEER_CUDA_SITE:-} | tee "$P/cuda_args.txt" | grep -v '^#')
    log "build: extra CMake arguments: ${extra[*]:-none}"
    cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra[@]}" \
      -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$nvcc" -DGGML_CUDA_NCCL=OFF \
      -DGGML_CUDA_COMPRESSION_MODE=none -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
      ${PEER_CMAKE_ARGS:-} > "$P/configure.log" 2>&1 || { log "configure failed"; tail -40 "$P/configure.log" | tee -a "$LOG"; return 1; }
  fi
  t1=$(date +%s)
  local budget; budget=$(left "${BUILD_TIMEOUT:-500}")
  log "build: ninja -j ${JOBS:-16} llama-bench, at most $budget s"
  timeout "$budget" ninja -C "$BUILD" -j "${JOBS:-16}" llama-bench > "$P/build.log" 2>&1
  rc=$?
  t2=$(date +%s)
  tail -5 "$P/build.log" >> "$LOG"
  [ $rc -eq 124 ] && log "build: stopped at BUILD_TIMEOUT; run the build phase again on this warm machine to go on"
  [ $rc -ne 0 ] && grep -m5 -B2 -A8 "error" "$P/build.log" >> "$LOG"
  python3 - "$P/build.json" "$rc" "$((t1 - t0))" "$((t2 - t1))" "${JOBS:-16}" "$(nproc)" <<'EOF'
import json, sys
p, rc, conf, build, jobs, nproc = sys.argv[1:]
old = json.load(open(p)) if __import__("os").path.exists(p) else {}
json.dump({"rc": int(rc), "configure_s": int(conf), "build_s": int(build) + old.get("build_s", 0) * (old.get("rc") == 124),
           "jobs": int(jobs), "nproc": int(nproc), "target": "llama-bench", "cuda_arch": "90",
           "flags": "GGML_CUDA=ON CMAKE_CUDA_ARCHITECTURES=90 GGML_CUDA_NCCL=OFF GGML_CUDA_COMPRESSION_MODE=none GGML_NATIVE=ON LLAMA_OPENSSL=OFF"},
          open(p, "w"), indent=1)
EOF
  keep build.json
  log "build rc=$rc configure $((t1 - t0)) s, build $((t2 - t1)) s"
  cuda_libs
  [ -x "$BENCH" ] && "$BENCH" --version >> "$LOG" 2>&1 && "$BENCH" --list-devices >> "$LOG" 2>&1
  [ -x "$BENCH" ]
}

phase_gguf() {
  unpack || return 1
  mkdir -p "$(dirname "$GGUF")"
  local want
  want=$(PYTHONPATH=$SRC/gguf-py:${PYTHONPATH:-} py -m reap_swap.benchmarks.peers_gguf --out "$GGUF" --plan-only ${GGUF_ARGS:-} |
    python3 -c "import json,sys; print(json.load(sys.stdin)['tensor_bytes'])")
  if [ -f "$GGUF" ] && [ "$(stat -c %s "$GGUF")" -gt "${want:-0}" ] && [ -f "$P/gguf.json" ]; then
    log "gguf: $GGUF already there"; keep gguf.json; return 0
  fi
  log "gguf: writing $GGUF ($want tensor bytes; /dev/shm free ${shm_free:-?} GiB)"
  PYTHONPATH=$SRC/gguf-py:${PYTHONPATH:-} py -m reap_swap.benchmarks.peers_gguf --out "$GGUF" ${GGUF_ARGS:-} > "$P/gguf.json" 2>> "$LOG" \
    || { log "gguf failed"; rm -f "$GGUF"; return 1; }
  keep gguf.json
  log "gguf: $(cat "$P/gguf.json")"
}

bench_meta() {  # $1 = file, rest = the command
  local f=$1; shift
  python3 - "$f" "$N_CPU_MOE" "$CPUS" "$P/gguf.json" "$P/build.json" "$@" <<'EOF'
import json, os, sys
f, ncmoe, cpus, gguf, build, *cmd = sys.argv[1:]
load = lambda p: json.load(open(p)) if os.path.exists(p) else None
json.dump({"command": " ".join(cmd), "n_cpu_moe": int(ncmoe), "cpus": cpus,
           "n_cpu_moe_why": "reap_30_cpu keeps 38/128 experts of each of 24 layers on the GPU (29.7 % of expert bytes); "
                            "llama.cpp keeps whole layers: 7 of 24 layers' experts on the GPU (29.2 %) = --n-cpu-moe 17",
           "gguf": load(gguf), "build": load(build)}, open(f, "w"), indent=1)
EOF
}

cuda_libs() {  # the cuBLAS folder the build linked from a wheel, for the loader
  local d; d=$(sed -n 's/^#LD //p' "$P/cuda_args.txt" 2>/dev/null)
  [ -n "$d" ] && export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  return 0
}

phase_bench() {
  cuda_libs
  [ -x "$BENCH" ] || { log "bench: no llama-bench yet, building first"; phase_build || return 1; }
  [ -f "$GGUF" ] || { log "bench: no GGUF yet, writing it first"; phase_gguf || return 1; }
  keep build.json gguf.json
  local cmd=("$BENCH" -m "$GGUF" -ngl 99 -ncmoe "$N_CPU_MOE" -t "$NT" -C "$MASK" --cpu-strict 1 -fa on
             -p 256,512,2048 -n 128 -r "${REPS:-3}" -o json)
  log "bench: ${cmd[*]}"
  bench_meta "$OUT/llamacpp_bench.meta.json" "${cmd[@]}"
  timeout "$(left 330)" "${cmd[@]}" > "$OUT/llamacpp_bench.json" 2> "$P/bench.err"; local rc=$?
  tail -25 "$P/bench.err" >> "$LOG"; log "bench rc=$rc"
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1])): print('pp%d tg%d: %.1f tok/s' % (r['n_prompt'], r['n_gen'], r['avg_ts']))" "$OUT/llamacpp_bench.json" 2>&1 | tee -a "$LOG"
  if [ "${ALL_GPU:-1}" = 1 ]; then
    local cmd2=("$BENCH" -m "$GGUF" -ngl 99 -ncmoe 0 -t "$NT" -C "$MASK" --cpu-strict 1 -fa on -p 512,2048 -n 128 -r "${REPS:-3}" -o json)
    log "bench all-GPU: ${cmd2[*]}"
    timeout "$(left 150)" "${cmd2[@]}" > "$OUT/llamacpp_all_gpu.json" 2> "$P/bench2.err"; log "bench all-GPU rc=$?"
    tail -5 "$P/bench2.err" >> "$LOG"
  fi
  return $rc
}

phase_kt() {
  [ -n "$WHEEL" ] || { log "kt: no kt-kernel wheel under .peers/: carry it"; return 1; }
  unpack || return 1  # kt_kernel imports gguf: the pinned gguf-py serves
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kt_site "$WHEEL" >> "$LOG" 2>&1 \
    || log "kt: pip install failed: ours alone is measured (kt_kernel.importable says why)"
  local ts=()
  [ "${KT_TASKSET:-1}" = 1 ] && command -v taskset > /dev/null && ts=(taskset -c "$CPUS")
  log "kt: ${ts[*]} bench_cpu_kernel --threads $NT --cpus $CPUS --backends native --kt"
  (cd /tmp && PYTHONPATH=/tmp/kt_site:$SRC/gguf-py:${PYTHONPATH:-} timeout "$(left 300)" "${ts[@]}" python3 -m reap_swap.server_ext.cpu_experts.bench_cpu_kernel \
    --out "$OUT/kt_vs_ours.json" --threads "$NT" --cpus "$CPUS" --backends native --kt ${KT_ARGS:-} \
    --label "H200 host, issue 28: ours (native) and kt-kernel 0.6.1 AMXBF16_MOE, $NT threads on cores $CPUS, GPU idle") >> "$LOG" 2>&1
  local rc=$?; log "kt rc=$rc"
  if [ $rc -ne 0 ] && [ -d /tmp/kt_site/kt_kernel ] && [ -z "${KT_MOE_CLASS:-}" ]; then
    # AMX refused (a sandbox that grants no AMX tile state?): the same calls through AVX2BF16_MOE
    log "kt: again with KT_MOE_CLASS=AVX2BF16_MOE -> kt_vs_ours_avx2.json"
    (cd /tmp && KT_MOE_CLASS=AVX2BF16_MOE PYTHONPATH=/tmp/kt_site:$SRC/gguf-py:${PYTHONPATH:-} timeout "$(left 200)" "${ts[@]}" \
      python3 -m reap_swap.server_ext.cpu_experts.bench_cpu_kernel --out "$OUT/kt_vs_ours_avx2.json" --threads "$NT" --cpus "$CPUS" \
      --backends native --kt ${KT_ARGS:-} --label "H200 host, issue 28: kt-kernel 0.6.1 AVX2BF16_MOE (the AMX run died)") >> "$LOG" 2>&1
    log "kt (AVX2) rc=$?"
  fi
  return $rc
}

phase_ours() {  # ours on this machine, in this session: the dummy-routing arms at 256 (decode) and 2048 (TTFT) tokens
  local arms=${OURS_ARMS:-stock_offload,reap_30,reap_30_cpu,reap_30_fast}
  log "ours: bench-gpu --arms $arms --ttft-only --prompt-len 256,2048 --gen ${OURS_GEN:-64}, CPU team on cores $CPUS"
  REAP_CPU_EXPERT_CPUS=$CPUS rs bench-gpu --shape 30b-a3b-24l --arms "$arms" --ttft-only --prompt-len 256,2048 --gen "${OURS_GEN:-64}" \
    --no-sweep --profile-steps 0 --workdir "$P/ours" --resume --deadline-s "$(left 560)" --out "$P/bench_gpu_peers_ours.json" \
    > "$P/ours.log" 2>&1; local rc=$?
  tail -c 2500 "$P/ours.log" >> "$LOG"; cp "$P/ours/arms.log" "$OUT/ours_arms.log" 2>/dev/null
  keep bench_gpu_peers_ours.json bench_gpu_peers_ours.md
  log "ours rc=$rc"
  return $rc
}

status=0
IFS=, read -ra list <<< "$PHASES"
for ph in "${list[@]}"; do
  case $ph in
    build|gguf|bench|kt|ours) t=$(date +%s); "phase_$ph" || status=1; log "phase $ph: $(( $(date +%s) - t )) s" ;;
    *) echo "unknown phase $ph (build, gguf, bench, kt, ours; or report DIR)"; exit 2 ;;
  esac
done
exit $status
