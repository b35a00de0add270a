"""Quantized collectives: int8 gathers and int8/int4 reductions with error feedback."""
