"""The training pipeline: config, loop, optimizer and schedule, checkpoints, metrics, evaluation."""
