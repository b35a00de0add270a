"""Checkpoints that cannot come back mixed: ``save_checkpoint`` and ``load_checkpoint``.

``torch.distributed.checkpoint.save`` writes every rank's files into the directory it is
given, in place. Saving over the previous checkpoint (``checkpoint_id="ckpt/latest"`` every
N steps) and losing a rank in the middle leaves a directory whose metadata is the old one
and whose data files are partly new: it loads without an error and holds two steps' values.

A checkpoint here is a DCP directory that holds a ``COMPLETE`` marker: a small JSON file with
its sequence number (one more than the checkpoint it replaces). Only ``load_checkpoint``'s
three candidates count, ``path``, ``<path>.previous`` and ``<path>.partial``; it loads the
one with a marker and the highest sequence number, whichever of the three holds it. (A
directory without a marker, at ``path`` or ``<path>.previous``, with DCP's ``.metadata``, as
plain ``dcp.save`` or an older zeroc wrote, counts as sequence 0.)

``save_checkpoint(state, path)`` (collective) does, in order:

1. Rank 0 repairs what an interrupted save left (``_settle``, below), so that ``path``
   holds the newest checkpoint, if any, and nothing else is there. Barrier.
2. Every rank writes its part with ``dcp.save`` into ``<path>.partial``. Barrier: the
   directory is whole now, but has no marker, so a loss up to here never counts.
3. Rank 0 writes the marker: ``COMPLETE.tmp``, fsync'd, renamed to ``COMPLETE``, the
   directory fsync'd. That rename is the commit; from then on the new checkpoint is the
   newest one, found in ``<path>.partial`` if the save stops here.
4. Rank 0 puts it in place (``_settle`` again): renames ``path`` to ``<path>.previous``
   (or removes ``path`` if it holds no checkpoint), ``<path>.partial`` to ``path``, then
   removes ``<path>.previous``. Between the renames both are whole and the new one, with
   the higher number, is what loads. Barrier.

``_settle`` only removes directories that are not the newest checkpoint, and removes each
marker first (a half-removed directory is no checkpoint, or one of sequence 0, older than
the one it was removed for), so the newest checkpoint is never deleted, whatever order of
kills came before; renames are atomic, so it is always whole in one of the three places. It
is idempotent: a save killed at any step, any number of times in a row, leaves a state the
next ``_settle`` (the next save's step 1) finishes. What loads is exactly one step's state,
the newest whose marker was written. The directory must be on a file system every rank
sees (as DCP's own).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from zeroc.runtime.torch_compat import dcp_flat_keys

__all__ = ["load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)

PARTIAL, PREVIOUS = ".partial", ".previous"
MARKER = "COMPLETE"
_DCP_METADATA = ".metadata"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _is_rank0() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _check_path(path: Any, caller: str) -> str:
    if isinstance(path, dict):  # the state passed where the path goes: say so, briefly
        raise TypeError(f"zeroc.{caller}(state, path): path is a dict (keys "
                        f"{sorted(map(str, path))[:5]}); the state comes first, then the "
                        "directory path")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        shown = repr(path) if len(repr(path)) <= 80 else f"a {type(path).__name__}"
        raise ValueError(f"zeroc.{caller}: path={shown} must be a directory path (a str or "
                         "os.PathLike)")
    return os.path.abspath(os.fspath(path))


def _candidates(target: str) -> tuple[str, str, str]:
    """Where a checkpoint of ``target`` may be, in the order that wins a tie."""
    return target, target + PREVIOUS, target + PARTIAL


def _fsync_dir(directory: str) -> None:
    """Make the renames and removals in ``directory`` durable (where the OS allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sequence(directory: str, target: str) -> int | None:
    """The sequence number of the checkpoint in ``directory``, None if it is not one."""
    marker = os.path.join(directory, MARKER)
    try:
        with open(marker, encoding="utf-8") as file:
            sequence = json.load(file)["sequence"]
        if type(sequence) is int and sequence >= 0:
            return sequence
        log.warning("zeroc: %s holds sequence %r, not a number >= 0; ignoring %s", marker,
                    sequence, directory)
        return None
    except (FileNotFoundError, NotADirectoryError):
        pass
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("zeroc: cannot read the checkpoint marker %s (%s); ignoring %s", marker,
                    error, directory)
        return None
    if directory != target + PARTIAL and os.path.isfile(os.path.join(directory,
                                                                      _DCP_METADATA)):
        return 0  # written by plain dcp.save or by an older zeroc, which had no marker
    return None


def _newest(target: str) -> tuple[str | None, int]:
    """The directory holding the newest checkpoint of ``target`` and its sequence number
    (None and -1 when there is none)."""
    best, best_sequence = None, -1
    for directory in _candidates(target):
        sequence = _sequence(directory, target)
        if sequence is not None and sequence > best_sequence:
            best, best_sequence = directory, sequence
    return best, best_sequence


def _discard(directory: str) -> None:
    """Remove ``directory``, its marker first: a removal cut short leaves no marked
    checkpoint."""
    if not os.path.lexists(directory):
        return
    marker = os.path.join(directory, MARKER)
    try:
        if os.path.lexists(marker):
            os.unlink(marker)
            _fsync_dir(directory)
        shutil.rmtree(directory)
    except OSError as error:
        raise OSError(f"zeroc.save_checkpoint: cannot remove {directory}, left by an earlier "
                      f"save ({error})") from error
    log.debug("zeroc: removed %s", directory)


def _rename(source: str, destination: str) -> None:
    try:
        os.rename(source, destination)
    except OSError as error:
        raise OSError(f"zeroc.save_checkpoint: cannot rename {source} to {destination} "
                      f"({error})") from error
    _fsync_dir(os.path.dirname(destination))


def _settle(target: str) -> int:
    """Leave the newest checkpoint of ``target`` at ``target`` and nothing beside it; return
    its sequence number (-1 when there is none). Removes only what is not the newest."""
    current, previous, partial = _candidates(target)
    best, sequence = _newest(target)
    for directory in (partial, previous):
        if directory != best:
            _discard(directory)
    if best is None:
        _discard(current)  # neither a checkpoint nor anything load_checkpoint would read
    elif best != current:
        log.info("zeroc: putting the checkpoint in %s (sequence %d) in place at %s", best,
                 sequence, current)
        if best == partial and _sequence(current, target) is not None:
            _rename(current, previous)  # the older one stays until the newer is in place
            _rename(partial, current)
            _discard(previous)
        else:
            _discard(current)
            _rename(best, current)
    return sequence


def _write_marker(directory: str, sequence: int) -> None:
    """Commit the checkpoint in ``directory``: its marker appears whole or not at all."""
    marker = os.path.join(directory, MARKER)
    temporary = marker + ".tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump({"sequence": sequence}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, marker)
    except OSError as error:
        raise OSError(f"zeroc.save_checkpoint: cannot write the marker {marker} of the new "
                      f"checkpoint ({error})") from error
    _fsync_dir(directory)


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> str:
    """Save ``state`` (what ``dcp.save`` takes) as the checkpoint at ``path``, replacing the
    previous one only once every rank has written the new one. Collective; returns the
    absolute path."""
    target = _check_path(path, "save_checkpoint")
    partial = target + PARTIAL
    if _is_rank0():
        os.makedirs(os.path.dirname(target), exist_ok=True)
        _settle(target)  # finish what an interrupted save left; empties <path>.partial
    _barrier()
    dcp.save(state, checkpoint_id=partial)
    _barrier()  # every rank has written its part: the new checkpoint is whole
    if _is_rank0():
        _write_marker(partial, max(_newest(target)[1], 0) + 1)
        sequence = _settle(target)
        log.info("checkpoint saved to %s (sequence %d)", target, sequence)
    _barrier()
    return target


def load_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> str:
    """Load the newest checkpoint of ``path`` into ``state`` in place (what ``dcp.load``
    does): the one at ``path``, or, when a save was interrupted, the newest whole one it left
    in ``<path>.previous`` or ``<path>.partial``. Returns the directory read."""
    target = _check_path(path, "load_checkpoint")
    source, sequence = _newest(target)
    if source is None:
        present = [d for d in _candidates(target) if os.path.lexists(d)]
        if not present:
            raise FileNotFoundError(f"zeroc.load_checkpoint: no checkpoint at {target}")
        raise FileNotFoundError(
            f"zeroc.load_checkpoint: no complete checkpoint at {target}: none of "
            f"{', '.join(present)} holds a {MARKER} marker (nor, at {target} or its "
            f"{PREVIOUS}, DCP's {_DCP_METADATA}); a save was interrupted before every rank "
            "had written its part")
    if source != target:
        log.warning("zeroc: a save of %s was interrupted; loading the newest whole checkpoint "
                    "it left, %s (sequence %d)", target, source, sequence)
    dcp.load(state, checkpoint_id=source)
    _warn_unread(state, source)
    return source


def _warn_unread(state: dict[str, Any], source: str) -> None:
    """Say when the checkpoint holds entries under one of ``state``'s top-level keys that
    ``state`` has no place for, so they were not loaded: the classic case is an optimizer's
    ``state_dict()`` taken before its first step (empty), which loads no moments at all
    (``get_optimizer_state_dict(model, optimizer)`` makes the places)."""
    saved = set(dcp.FileSystemReader(source).read_metadata().state_dict_metadata)
    unread = sorted(k for k in saved - dcp_flat_keys(state) if k.split(".", 1)[0] in state)
    if unread:
        log.warning(
            "zeroc.load_checkpoint: %d entries of %s were not loaded: the state passed has no "
            "place for them (e.g. %s). An optimizer's state_dict() is empty before its first "
            "step; load into get_optimizer_state_dict(model, optimizer) (and "
            "get_model_state_dict(model)), then set_optimizer_state_dict", len(unread), source,
            ", ".join(unread[:3]))
