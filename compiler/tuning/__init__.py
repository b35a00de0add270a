"""Choosing a layout: zeroc.tune's search, screen, estimates and results, and zeroc.calibrate."""
