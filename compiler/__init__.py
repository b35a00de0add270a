"""zeroc: a torch.compile backend for ZeRO-sharded, pipelined training."""
