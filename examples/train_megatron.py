"""Train the reference model Megatron-style (DP x TP x PP); checkpoints go through interop's commit protocol.

    torchrun --nproc_per_node 2 examples/train_megatron.py --tp 2 --steps 8 --save-every 4
    torchrun --nproc_per_node 2 examples/train_megatron.py --pp 2 --microbatches 4 --pipeline-schedule gpipe
    torchrun --nproc_per_node 4 examples/train_megatron.py --tp 2 --pp 2 --activation-checkpointing --steps 8
    torchrun --nproc_per_node 2 examples/train_megatron.py --tp 2 --resume out/universal   # from another layout

On a machine without a GPU it runs on CPU processes with gloo (nothing to set). The data-parallel size is
the number of processes over tp x pp. Every checkpoint's dcp/ directory holds the logical tensors, so a run
of any other layout resumes from it; `interop convert` turns it into any other format.
"""

from trainers.megatron import main

if __name__ == "__main__":
    main()
