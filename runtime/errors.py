"""Error types every layer of zeroc may raise (kept at the bottom so all layers can import)."""

from __future__ import annotations


class OptionError(ValueError):
    """A bad ``torch.compile`` option or mode: names the key, the value and what is allowed."""


class CollectiveError(RuntimeError):
    """A collective of a compiled graph failed or timed out: another rank died, hung or
    diverged (an error of this rank's own ops is raised as it is)."""


class ModelChangedError(RuntimeError):
    """A change to a parallelized model that zeroc cannot carry into its shards."""
