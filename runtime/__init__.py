"""Bottom layer: the Plan IR, the cost model, the executor, mesh and collectives."""
