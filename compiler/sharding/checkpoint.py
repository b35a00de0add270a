"""Checkpoints that cannot come back mixed: ``save_checkpoint`` and ``load_checkpoint``.

``torch.distributed.checkpoint.save`` writes every rank's files into the directory it is
given, in place. Saving over the previous checkpoint (``checkpoint_id="ckpt/latest"`` every
N steps) and losing a rank in the middle leaves a directory whose metadata is the old one
and whose data files are partly new: it loads without an error and holds two steps' values.

``save_checkpoint(state, path)`` saves into a fresh directory beside ``path``
(``<path>.partial``, emptied first), waits until every rank has written its part (a
barrier), and only then puts it in place: rank 0 renames the previous checkpoint to
``<path>.previous``, the new one to ``path``, and removes the previous one; a last barrier
returns on every rank once it is in place. A rank lost before the first barrier leaves
``path`` as it was; one lost between the two renames leaves ``<path>.previous``, which
``load_checkpoint`` reads when ``path`` is missing. Either way what loads is exactly one
step's state. The directory must be on a file system every rank sees (as DCP's own).
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)

PARTIAL, PREVIOUS = ".partial", ".previous"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _is_rank0() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _check_path(path: Any, caller: str) -> str:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"zeroc.{caller}: path={path!r} must be a directory path (a str or "
                         "os.PathLike)")
    return os.path.abspath(os.fspath(path))


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> str:
    """Save ``state`` (what ``dcp.save`` takes) as the checkpoint at ``path``, replacing the
    previous one only once every rank has written the new one. Collective; returns the
    absolute path."""
    target = _check_path(path, "save_checkpoint")
    partial = target + PARTIAL
    if _is_rank0():
        shutil.rmtree(partial, ignore_errors=True)  # what a lost save left
        os.makedirs(os.path.dirname(target), exist_ok=True)
    _barrier()
    dcp.save(state, checkpoint_id=partial)
    _barrier()  # every rank has written its part: the new checkpoint is whole
    if _is_rank0():
        previous = target + PREVIOUS
        shutil.rmtree(previous, ignore_errors=True)
        if os.path.exists(target):
            os.rename(target, previous)
        os.rename(partial, target)
        shutil.rmtree(previous, ignore_errors=True)
        log.info("checkpoint saved to %s", target)
    _barrier()
    return target


def load_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> str:
    """Load the checkpoint at ``path`` into ``state`` in place (what ``dcp.load`` does), or,
    when a save was lost between its renames, the previous one it kept. Returns the
    directory read."""
    target = _check_path(path, "load_checkpoint")
    source = target
    if not os.path.exists(target) and os.path.exists(target + PREVIOUS):
        source = target + PREVIOUS
        log.warning("zeroc: %s is missing (a save was interrupted while putting it in place); "
                    "loading the previous checkpoint %s", target, source)
    if not os.path.exists(source):
        raise FileNotFoundError(f"zeroc.load_checkpoint: no checkpoint at {target}")
    dcp.load(state, checkpoint_id=source)
    return source
