"""The front end: the torch.compile backend, its Config, capture of one graph into forward and
backward graphs, and the checks a compiled graph passes before it runs."""
