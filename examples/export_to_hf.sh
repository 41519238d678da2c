#!/usr/bin/env bash
# A DeepSpeed ZeRO-3 checkpoint -> a Hugging Face model directory, checked against DeepSpeed's own
# zero_to_fp32.py; then Hugging Face -> Megatron-LM (TP2 x PP2) -> Hugging Face, bit for bit.
# Runs as written on CPU; OUT sets where files go.
#
#   bash examples/export_to_hf.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/examples/export_to_hf}
rm -rf "$OUT" && mkdir -p "$OUT"

torchrun --nproc_per_node 2 -m trainers.deepspeed --zero-stage 3 --steps 4 --output-dir "$OUT/zero3" > /dev/null
CKPT="$OUT/zero3/checkpoint-4"

interop convert "$CKPT" "$OUT/hf" --to hf
python "$CKPT/zero_to_fp32.py" "$OUT/zero3" "$OUT/zero_to_fp32" --safe_serialization   # the run's root: 'latest' names CKPT
cp "$OUT/hf/config.json" "$OUT/zero_to_fp32/"                  # DeepSpeed's tool writes the weights only
interop diff "$OUT/hf" "$OUT/zero_to_fp32" --model-only          # exit 1 on any difference

interop convert "$OUT/hf" "$OUT/megatron" --to megatron --tp 2 --pp 2
interop convert "$OUT/megatron" "$OUT/hf-again" --to hf
interop diff "$OUT/hf" "$OUT/hf-again"

python - "$OUT/hf" <<'PY'
import sys, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = model.generate(torch.tensor([list(b"The ")]), max_new_tokens=8, do_sample=False, pad_token_id=0)
print("from_pretrained + generate:", bytes(ids[0].tolist()).decode("utf-8", "replace"))
PY
