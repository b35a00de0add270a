"""Error types every layer of zeroc may raise (kept at the bottom so all layers can import)."""

from __future__ import annotations


class OptionError(ValueError):
    """A bad ``torch.compile`` option or mode: names the key, the value and what is allowed."""


class CollectiveError(RuntimeError):
    """A compiled graph failed while communicating: another rank died, hung or diverged."""
