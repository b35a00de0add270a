"""The files of zeroc's on-disk cache: private directories, atomic writes, checked reads.

zeroc imports the kernel sources it finds in ``<cache_dir>/kernels`` and launches the
configurations it finds in ``<cache_dir>/autotune``, so only their owner may be able to write
there. Every directory of the cache is created with mode ``0o700``; an existing one must be
owned by the current user and not writable by group or others, otherwise the cache is refused
with an :class:`~zeroc.runtime.errors.OptionError` (a ``ValueError``) that names the directory
and what to do. Files are written to a temporary file in the same directory and renamed into
place, so a reader never sees half a file. What is read back is checked by its reader (kernel
sources by content hash in ``compile_cache``, tuning records by their fields in ``autotune``);
a file that fails the check is rewritten, with a warning, never trusted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
from typing import Any

from zeroc.runtime.errors import OptionError

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/zeroc"
DIR_MODE = 0o700


def resolve_cache_dir(cache_dir: str | None) -> str:
    """The absolute cache directory (``~`` expanded); ``None`` means the default."""
    return os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR))


def check_private_dir(path: str, cache_dir: str | None = None) -> None:
    """Raise OptionError unless ``path`` is a directory of the current user that group and
    others cannot write (``cache_dir`` is the option's value, for the message)."""
    option = f"option cache_dir={cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR!r}"
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise OptionError(f"zeroc: {option}: {path} is not a directory; set cache_dir to a "
                          "directory of your own (default ~/.cache/zeroc)")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise OptionError(
            f"zeroc: {option}: directory {path} is owned by uid {info.st_uid}, not by you "
            f"(uid {os.getuid()}); zeroc imports the kernel files it finds there, so it only "
            "uses a cache directory you own: set cache_dir to a directory of your own "
            "(default ~/.cache/zeroc) or remove this one")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OptionError(
            f"zeroc: {option}: directory {path} is writable by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):#o}); zeroc imports the kernel files it finds "
            f"there, so it refuses a directory others can write: run 'chmod 700 {path}' or "
            "set cache_dir to a private directory")


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


def private_dir(cache_dir: str | None, *parts: str) -> str:
    """``<cache_dir>/<parts...>``, created private (0o700) where missing, and checked (see
    :func:`check_private_dir`) from the cache root down; returns its absolute path."""
    root = resolve_cache_dir(cache_dir)
    path = os.path.join(root, *parts)
    _make_private(path)
    current = root
    check_private_dir(current, cache_dir)
    for part in parts:
        current = os.path.join(current, part)
        check_private_dir(current, cache_dir)
    return path


def atomic_write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file (mode 0o600) renamed into place."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
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


def read_json(path: str) -> Any:
    """The JSON value of ``path``; None when it is missing or not valid JSON (logged)."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        logger.warning("zeroc cache: %s is not valid JSON (%s); it will be replaced", path, exc)
        return None
