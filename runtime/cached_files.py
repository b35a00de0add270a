"""Every file zeroc keeps in its cache and reads back: private directories, checked records.

zeroc keeps in ``<cache_dir>`` (default ``~/.cache/zeroc``) what it generated or measured:
kernel sources (``kernels/``, imported), kernel launch configurations (``autotune/``), tune
results and layouts (``tune/``), calibrated profiles (``calibration/``, ``hardware/``) and
op-time tables (``op_times/``). What is read back decides what runs, with which options, and
what a plan estimates, so all of it goes through this module:

* Directories are created with mode ``0o700``. Writing into one that another user owns or that
  group or others can write raises :class:`~zeroc.runtime.errors.OptionError` naming it
  (:func:`private_dir`); files are written through a temporary file (mode ``0o600``) renamed
  into place (:func:`atomic_write`), so a reader never sees half a file.
* A record (every cache file but a kernel's source, which is checked against the source zeroc
  generates again) is one JSON object ``{"zeroc_cache": kind, "format": N, "key": ...,
  "data": ..., "sha256": ...}``: the checksum covers the canonical JSON of the other four.
* :func:`read_record` returns a record's data only when the file and every directory from the
  cache root down to it are the user's and not writable by group or others, the file is a
  regular file (not a link) within its size limit and strict JSON (no NaN or Infinity), its
  kind, format and checksum are right, its key equals the one looked up (what it was made
  for: model, machine, versions) and the caller's ``check`` (schema and ranges, built from
  :func:`number`, :func:`integer`, :func:`text` and :func:`fields`) accepts the data.
  Anything else is ignored with one log line naming the file and why, and the caller
  measures or plans again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from zeroc.runtime.errors import OptionError

__all__ = ["DEFAULT_CACHE_DIR", "RecordError", "atomic_write", "check_private_dir", "checksum",
           "fields", "file_problem", "integer", "number", "private_dir", "read_record",
           "read_text", "resolve_cache_dir", "store_record", "text", "write_record"]

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/zeroc"
DIR_MODE = 0o700
MAX_BYTES = 16 << 20  # a record larger than this is refused unless its reader allows more
_ENVELOPE = ("data", "format", "key", "sha256", "zeroc_cache")


class RecordError(ValueError):
    """A cached record that does not fit its schema (the message says where and why)."""


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> str:
    """The absolute cache directory (``~`` expanded); ``None`` means the default."""
    return os.path.abspath(os.path.expanduser(os.fspath(cache_dir or DEFAULT_CACHE_DIR)))


def file_problem(path: str, directory: bool = False) -> str | None:
    """Why ``path`` may not be trusted (another user's, writable by group or others, a link
    or not a regular file / directory), or None when it may."""
    info = os.lstat(path) if not directory else os.stat(path)
    kind = "directory" if directory else "file"
    if not directory and stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if not (stat.S_ISDIR if directory else stat.S_ISREG)(info.st_mode):
        return f"{path} is not a {'directory' if directory else 'regular file'}"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"{kind} {path} is owned by uid {info.st_uid}, not by you (uid {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{kind} {path} is writable by group or others (mode "
                f"{stat.S_IMODE(info.st_mode):#o})")
    return None


def check_private_dir(path: str, cache_dir: str | None = None) -> None:
    """Raise OptionError unless ``path`` is a directory of the current user that group and
    others cannot write (``cache_dir`` is the option's value, for the message)."""
    option = f"option cache_dir={cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR!r}"
    problem = file_problem(path, directory=True)
    if problem is None:
        return
    if "not a directory" in problem:
        fix = "set cache_dir to a directory of your own (default ~/.cache/zeroc)"
    elif "owned by" in problem:
        fix = ("set cache_dir to a directory of your own (default ~/.cache/zeroc) or remove "
               "this one")
    else:
        fix = f"run 'chmod 700 {path}' or set cache_dir to a private directory"
    raise OptionError(f"zeroc: {option}: {problem}; zeroc imports and applies the files it "
                      f"finds there, so it only uses a cache directory only you can write: {fix}")


def _make_private(path: str) -> None:
    """Create ``path`` (and missing parents) with mode 0o700, whatever the umask."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        _make_private(parent)
    with contextlib.suppress(FileExistsError):  # another process made it first
        os.mkdir(path, DIR_MODE)
        os.chmod(path, DIR_MODE)


def private_dir(cache_dir: str | os.PathLike[str] | None, *parts: str) -> str:
    """``<cache_dir>/<parts...>``, created private (0o700) where missing, and checked (see
    :func:`check_private_dir`) from the cache root down; returns its absolute path."""
    root = resolve_cache_dir(cache_dir)
    path = os.path.join(root, *parts)
    _make_private(path)
    current = root
    shown = None if cache_dir is None else os.fspath(cache_dir)
    check_private_dir(current, shown)
    for part in parts:
        current = os.path.join(current, part)
        check_private_dir(current, shown)
    return path


def atomic_write(path: str, content: str) -> None:
    """Write ``content`` to ``path`` through a temporary file (mode 0o600) renamed into place."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_text(path: str) -> str | None:
    """The UTF-8 text of ``path``; None when it is missing or cannot be read as text."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        logger.warning("zeroc cache: cannot read %s (%s); it will be rewritten", path, exc)
        return None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def checksum(kind: str, fmt: int, key: Any, data: Any) -> str:
    """The SHA-256 (hex) a record of ``kind`` and ``fmt`` holding ``key`` and ``data`` carries."""
    body = _canonical({"data": data, "format": fmt, "key": key, "zeroc_cache": kind})
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def write_record(root: str, path: str, kind: str, fmt: int, key: Any, data: Any) -> None:
    """Store ``data`` for ``key`` as a record at ``path`` under the cache root ``root``: the
    directories from ``root`` down are made private and checked (OptionError when another
    user's or writable by others), the file replaced atomically. NaN and infinities raise
    ValueError: a record holds finite numbers only."""
    directory = os.path.dirname(os.path.abspath(path))
    root = os.path.abspath(root)
    relative = os.path.relpath(directory, root)
    parts = () if relative == "." else tuple(relative.split(os.sep))
    if parts and parts[0] == os.pardir:
        raise ValueError(f"zeroc cache: {path} is not under the cache directory {root}")
    private_dir(root, *parts)
    record = {"zeroc_cache": kind, "format": fmt, "key": key, "data": data,
              "sha256": checksum(kind, fmt, key, data)}
    atomic_write(path, json.dumps(record, indent=1, sort_keys=True, allow_nan=False) + "\n")


def store_record(root: str, path: str, kind: str, fmt: int, key: Any, data: Any, what: str,
                 log: logging.Logger | None = None) -> None:
    """:func:`write_record` for a cache that only saves time (a profile, an op-time table): a
    failure, a directory another user owns or others can write included, is only logged."""
    try:
        write_record(root, path, kind, fmt, key, data)
    except (OSError, ValueError) as exc:
        (log or logger).warning("could not store the %s in %s: %s", what, path, exc)


def _directories(path: str, root: str | None) -> list[str]:
    """The directories from ``root`` down to ``path``'s (only its own when not under root)."""
    directory = os.path.dirname(os.path.abspath(path))
    if root is None:
        return [directory]
    root = os.path.abspath(root)
    relative = os.path.relpath(directory, root)
    if relative.split(os.sep)[0] == os.pardir:
        return [directory]
    found, current = [root], root
    for part in ([] if relative == "." else relative.split(os.sep)):
        current = os.path.join(current, part)
        found.append(current)
    return found


def _reject_constant(name: str) -> Any:
    raise RecordError(f"it holds {name}, not a finite number")


def _difference(found: Any, key: Any) -> str:
    if not isinstance(found, Mapping) or not isinstance(key, Mapping):
        return f"made for {found!r}, here {key!r}"
    return "made for another setup: " + "; ".join(
        f"{k} = {found.get(k)!r}, here {key.get(k)!r}"
        for k in sorted({*found, *key}, key=str) if found.get(k) != key.get(k))


def _load(path: str, kind: str, fmt: int, key: Any, root: str | None, max_bytes: int) -> Any:
    """The checked envelope's data; raises RecordError (or OSError) saying why not."""
    for directory in _directories(path, root):
        problem = file_problem(directory, directory=True)
        if problem is not None:
            raise RecordError(problem)
    problem = file_problem(path)
    if problem is not None:
        raise RecordError(problem)
    size = os.lstat(path).st_size
    if size > max_bytes:
        raise RecordError(f"it holds {size} bytes, more than the {max_bytes} allowed")
    with open(path, encoding="utf-8") as handle:
        content = handle.read(max_bytes + 1)
    try:
        entry = json.loads(content, parse_constant=_reject_constant)
    except RecordError:
        raise
    except ValueError as exc:
        raise RecordError(f"not valid JSON: {exc}") from None
    if not isinstance(entry, dict):
        raise RecordError(f"it holds a {type(entry).__name__}, not a zeroc cache record")
    if sorted(entry) != list(_ENVELOPE) or entry["zeroc_cache"] != kind:
        raise RecordError(f"not a zeroc {kind!r} record (keys {sorted(entry)}, kind "
                          f"{entry.get('zeroc_cache')!r})")
    if entry["format"] != fmt:
        raise RecordError(f"record format {entry['format']!r}, this zeroc reads {fmt}")
    if entry["sha256"] != checksum(kind, fmt, entry["key"], entry["data"]):
        raise RecordError("its checksum does not match its content (corrupt or edited)")
    if entry["key"] != key:
        raise RecordError(_difference(entry["key"], key))
    return entry["data"]


def read_record(path: str, kind: str, fmt: int, key: Any,
                check: Callable[[Any], Any] | None = None, *, what: str = "cache file",
                log: logging.Logger | None = None, root: str | None = None,
                action: str = "measuring again", max_bytes: int = MAX_BYTES) -> Any:
    """The data of the record at ``path`` (passed through ``check``, which raises
    ``ValueError`` naming what is wrong and may return a converted value), or None: absent
    (silently) or refused by any check of the module docstring (one warning on ``log``:
    ``ignoring the <what> in <path> (<why>); <action>``). ``root`` is the cache directory,
    checked from there down."""
    try:
        data = _load(path, kind, fmt, key, root, max_bytes)
        return data if check is None else check(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        (log or logger).warning("ignoring the %s in %s (%s); %s", what, path, exc, action)
        return None


def number(value: Any, where: str, low: float, high: float, *, above: bool = False) -> float:
    """``value`` as a float when it is a finite number in ``[low, high]`` (``(low, high]``
    with ``above``); raises RecordError naming ``where`` otherwise."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (value > low if above else value >= low)
          and value <= high)
    if not ok:
        bound = "(" if above else "["
        raise RecordError(f"{where} = {value!r} is not a number in {bound}{low:g}, {high:g}]")
    return float(value)


def integer(value: Any, where: str, low: int, high: int) -> int:
    """``value`` when it is an int in ``[low, high]``; raises RecordError otherwise."""
    if type(value) is not int or not low <= value <= high:
        raise RecordError(f"{where} = {value!r} is not an integer in [{low}, {high}]")
    return value


def text(value: Any, where: str, longest: int = 4096) -> str:
    """``value`` when it is a string of at most ``longest`` characters on one line."""
    if not isinstance(value, str) or len(value) > longest or "\n" in value:
        raise RecordError(f"{where} = {str(value)[:80]!r} is not one line of at most "
                          f"{longest} characters")
    return value


def fields(value: Any, where: str, required: Iterable[str],
           optional: Iterable[str] = ()) -> dict[str, Any]:
    """``value`` when it is a dict with every key of ``required`` and no key outside
    ``required`` and ``optional``; raises RecordError naming the keys otherwise."""
    required, optional = set(required), set(optional)
    if not isinstance(value, dict):
        raise RecordError(f"{where} is a {type(value).__name__}, not a dict")
    missing, unknown = required - set(value), set(value) - required - optional
    if missing or unknown:
        raise RecordError(f"{where}: missing keys {sorted(missing)}, unknown keys "
                          f"{sorted(map(str, unknown))}")
    return value
