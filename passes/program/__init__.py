"""Program passes of a pipeline: the schedule, I/W split, F&B overlap and p2p lowering."""
