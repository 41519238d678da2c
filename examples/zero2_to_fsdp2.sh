#!/usr/bin/env bash
# DeepSpeed ZeRO-2 on 2 processes, stopped at step 4 of 8 -> one `interop convert` -> Accelerate FSDP2 on 2
# processes resumes and finishes the run. Runs as written on CPU (no GPU needed); OUT sets where files go.
#
#   bash examples/zero2_to_fsdp2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/examples/zero2_to_fsdp2}
rm -rf "$OUT" && mkdir -p "$OUT"

# 1. the source run: 8 steps with a checkpoint every 4 (the uninterrupted run the resume must continue)
deepspeed --num_gpus 2 examples/train_deepspeed.py --deepspeed_config examples/ds_zero2.json \
    --steps 8 --save-every 4 --output-dir "$OUT/zero2" > "$OUT/zero2.log"

# 2. ZeRO-2 shards -> FSDP2's sharded layout for 2 processes (weights, AdamW state, schedule, data position)
interop convert "$OUT/zero2/checkpoint-4" "$OUT/fsdp2-start" --to accelerate --world-size 2 --fsdp
interop verify "$OUT/fsdp2-start" --quiet

# 3. the target run picks up at step 5
accelerate launch --config_file examples/fsdp2.yaml examples/train_accelerate.py --batch-size 4 \
    --steps 8 --resume "$OUT/fsdp2-start" --output-dir "$OUT/fsdp2" > "$OUT/fsdp2.log"

python examples/compare_losses.py "$OUT/zero2.log" "$OUT/fsdp2.log"
