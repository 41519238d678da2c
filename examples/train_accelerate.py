"""Train the reference model with Accelerate (DDP or FSDP2); checkpoints go through interop's commit protocol.

    accelerate launch --config_file examples/ddp.yaml examples/train_accelerate.py --steps 8 --save-every 4
    accelerate launch --config_file examples/fsdp2.yaml examples/train_accelerate.py --steps 8 --resume
    torchrun --nproc_per_node 2 examples/train_accelerate.py --fsdp --mixed-precision bf16 --steps 8

On a machine without a GPU it runs on CPU processes with gloo (nothing to set). Every checkpoint's
accelerate/ directory is plain `accelerator.save_state` output: `accelerator.load_state` and
`accelerate merge-weights` work on it; `interop convert` turns it into any other layout.
"""

from trainers.accelerate import main

if __name__ == "__main__":
    main()
