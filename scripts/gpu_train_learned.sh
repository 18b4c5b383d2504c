#!/usr/bin/env bash
# One GPU run (H200, no vLLM needed): train the 128-expert top-8 benchmark MoE and its CPU-sized
# sibling, report their routing against a random init, record routing traces on the benchmark
# workload, and observe the realistic corpus' train split for the planner and classifier.
# Usage (repo root on the GPU machine, .moe-data carried): bash scripts/gpu_train_learned.sh OUTDIR
# Reproduce the data first: models/train/README.md ("Corpus"), with --scale 0.5.
set -u
OUT=${1:?output dir}
R=$PWD
export PYTHONUNBUFFERED=1
source $R/scripts/device_shim.sh
DATA=$R/.moe-data/moe_data.npz.xz
BIG=/tmp/learned128; SIB=/tmp/learned128_cpu
L=/tmp/logs; mkdir -p $OUT $L
nvidia-smi --query-gpu=name,memory.total --format=csv > $L/gpu.txt 2>&1

# 1. the benchmark model: 24 MoE layers x 128 experts, top-8 (Qwen3-30B-A3B's routing shape)
timeout 270 python3 models/train/train_moe.py --data $DATA --out $BIG --minutes 4.0 --reserve-s 35 \
  --batch-size 64 --seq-len 512 --eval-every 0 --eval-windows 64 \
  --set num_experts=128 --set num_experts_per_tok=8 --set num_hidden_layers=24 --set hidden_size=128 \
  --set num_attention_heads=4 --set num_key_value_heads=2 --set head_dim=32 --set moe_intermediate_size=64 \
  > $L/train_big.log 2>&1 || echo "big training exited $?" >> $L/train_big.log
# 2. its CPU-sized sibling (<= 8 MB): 4 MoE layers x 128 experts, top-8, hidden 64 (SIBLING=0 skips it)
[ "${SIBLING:-1}" = 0 ] || timeout 85 python3 models/train/train_moe.py --data $DATA --out $SIB --minutes 1.1 --reserve-s 18 \
  --batch-size 128 --seq-len 512 --eval-every 0 --eval-windows 64 \
  --set num_experts=128 --set num_experts_per_tok=8 --set num_hidden_layers=4 --set hidden_size=64 \
  --set num_attention_heads=2 --set num_key_value_heads=1 --set head_dim=32 --set moe_intermediate_size=24 \
  > $L/train_sib.log 2>&1 || echo "sibling training exited $?" >> $L/train_sib.log
# 3. routing learned? (entropy, top share, domain MI vs a random init of the same config)
timeout 60 python3 models/train/routing_report.py --model $BIG --data $DATA --random --tokens-per-domain 4096 --out $BIG/routing.json > $L/report.log 2>&1
[ "${SIBLING:-1}" = 0 ] || timeout 25 python3 models/train/routing_report.py --model $SIB --data $DATA --random --out $SIB/routing.json >> $L/report.log 2>&1
# 4. routing traces on the benchmark workload: realistic test split + template prompts unlike it
#    (sampled: 32 + 32 requests x 96 new tokens; greedy: 16 + 16 x 64): batched decode, then one
#    teacher-forced forward per request captures the routing (all-expert GEMM forward)
for spec in "0.8 32 96 90" "0 16 64 60"; do set -- $spec
  (cd /tmp && timeout $4 python3 -c "import sys; from reap_swap.planning.trace_record import main; sys.exit(main(sys.argv[1:]))" \
    --model $BIG --corpus $R/example/realistic/test.jsonl $R/example/corpus/test.jsonl --per-file $2 --dense-moe --batch 32 \
    --max-new-tokens $3 --max-prompt-tokens 160 --temperature $1 --device cuda --out $OUT/learned128_t$1.npz) >> $L/traces.log 2>&1
done
# 5. REAP observation of the realistic train split (planner + classifier input)
(cd /tmp && timeout 75 python3 -c "import sys; from reap_swap.planning.observe import main; sys.exit(main(sys.argv[1:]))" \
  --model $BIG --corpus $R/example/realistic/train.jsonl --out /tmp/obs128 --device cuda --max-tokens 256 --batch-size 16 --max-samples 640) > $L/observe.log 2>&1
# 6. bring back (at most 8 files): sibling dir; the big model's card data and logs (no weights:
#    ~150 MB); the observation in <= 15 MB parts
du -sh $BIG $SIB /tmp/obs128 >> $L/gpu.txt 2>&1
[ "${SIBLING:-1}" = 0 ] || tar -C /tmp -cJf $OUT/sibling.tar.xz learned128_cpu
tar -C /tmp -cJf $OUT/card_and_logs.tar.xz learned128/eval.json learned128/train_log.jsonl learned128/config.json learned128/routing.json logs
tar -C /tmp -cf - obs128 | xz -T8 -6 | split -b 15M - $OUT/obs128.tar.xz.
ls -la $OUT; for f in $L/*.log; do echo "== $f"; tail -c 600 $f; done
