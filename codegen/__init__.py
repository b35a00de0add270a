"""Kernel IR, Triton emission, the kernel compile cache and kernel autotuning."""
