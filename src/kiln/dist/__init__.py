"""Distributed training on PyTorch's engine: parallel dims and mesh, parallelize (TP -> activation
checkpointing -> compile -> FSDP2/DDP), the strategy the training loop asks, collectives, checkpoints."""
