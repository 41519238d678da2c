#!/usr/bin/env bash
# A Megatron-style TP2 x PP2 run on 4 processes, stopped at step 4 of 8 -> one `interop convert` -> DeepSpeed
# ZeRO-3 on 2 processes resumes and finishes the run. Runs as written on CPU; OUT sets where files go.
#
#   bash examples/megatron_to_zero3.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/examples/megatron_to_zero3}
rm -rf "$OUT" && mkdir -p "$OUT"

torchrun --nproc_per_node 4 examples/train_megatron.py --tp 2 --pp 2 --microbatches 2 --batch-size 8 \
    --steps 8 --save-every 4 --output-dir "$OUT/megatron" > "$OUT/megatron.log"

# model and optimizer shards of 4 ranks -> ZeRO-3 partitions for 2 (DeepSpeed's own engine.load_checkpoint reads them)
interop convert "$OUT/megatron/checkpoint-4" "$OUT/zero3-start" --to deepspeed --world-size 2 --zero-stage 3
interop verify "$OUT/zero3-start" --quiet

torchrun --nproc_per_node 2 -m trainers.deepspeed --zero-stage 3 --batch-size 8 \
    --steps 8 --resume "$OUT/zero3-start" --output-dir "$OUT/zero3" > "$OUT/zero3.log"

python examples/compare_losses.py "$OUT/megatron.log" "$OUT/zero3.log"
