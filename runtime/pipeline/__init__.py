"""What runs a pipelined step: the executor, its messages, p2p, per-step ZeRO, outputs and
failures.
"""
