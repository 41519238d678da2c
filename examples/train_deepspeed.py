"""Train the reference model with DeepSpeed ZeRO; checkpoints go through interop's commit protocol.

    deepspeed --num_gpus 2 examples/train_deepspeed.py --deepspeed_config examples/ds_zero2.json --steps 8 --save-every 4
    deepspeed --num_gpus 2 examples/train_deepspeed.py --deepspeed_config examples/ds_zero3_bf16.json --resume

On a machine without a GPU it runs on DeepSpeed's CPU accelerator with gloo (nothing to set).
Every checkpoint holds DeepSpeed's own files beside our manifest, and the output directory's `latest` names
the newest: `engine.load_checkpoint(OUTPUT_DIR)` and `zero_to_fp32.py OUTPUT_DIR OUT` work on it as they are;
`interop convert` turns it into any other layout.
"""

from trainers.deepspeed import main

if __name__ == "__main__":
    main()
