"""The pp > 1 compile path: one traced graph cut into stages, each stage's graphs and kernels, and
the callable that runs a whole pipelined step."""
