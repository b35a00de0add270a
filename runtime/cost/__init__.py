"""The cost model: hardware profiles, calibration, per-op timings, step simulation."""
