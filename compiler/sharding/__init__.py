"""What a parallelized model holds: sharded parameters, meta initialization, state dicts, the
stages a pipeline rank keeps, and the training-loop helpers that read them."""
