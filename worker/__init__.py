"""Everything inside one training process: model, parallelism, loop, checkpoints."""
