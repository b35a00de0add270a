"""Planning a job for a world that is not here: zeroc's real program on fake tensors, fake CUDA,
the plan of each position, and what a planned rank counts (allocations, host syncs)."""
