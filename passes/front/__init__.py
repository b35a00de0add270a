"""The pipeline front's passes: the loss output, its normalization, hoisted gathers, shapes and
the stage split.
"""
