"""The multi-process tests launch their ranks with zeroc's local launcher."""

from zeroc.cli.launch import RankError, RankTimeout, run_ranks

__all__ = ["RankError", "RankTimeout", "run_ranks"]
