"""zeroc's own Triton kernels that are not generated: the fused linear + cross-entropy."""
