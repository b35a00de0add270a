"""The kernel compile cache: generated Triton source on disk, imported as a module.

``@triton.jit`` reads the source of the function it decorates, so every generated kernel is
written to a real ``.py`` file under ``<cache_dir>/kernels/`` named by a hash of the source and
the torch and triton versions. The name is predictable, so the file is never trusted: before a
module is imported, the file's content must hash to the source zeroc just generated; a file
that differs (another version's, a corrupt one, or one planted there) is replaced atomically
with a warning, and the module then runs the verified source text itself, not a re-read of the
file. A file that another user owns, that group or others can write, or that is a link is
replaced too. The cache directories are private (``zeroc.runtime.cached_files``: mode 0o700,
owned by the user, refused otherwise). A module is imported once per process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import types

import torch

from zeroc.runtime.cached_files import (
    DEFAULT_CACHE_DIR,
    atomic_write,
    file_problem,
    private_dir,
    read_text,
    resolve_cache_dir,
)

__all__ = ["DEFAULT_CACHE_DIR", "kernel_path", "load_kernel", "load_module", "resolve_cache_dir",
           "source_hash", "triton_version", "write_source"]

logger = logging.getLogger(__name__)

_modules: dict[str, types.ModuleType] = {}
_lock = threading.Lock()


def triton_version() -> str:
    """The installed triton version, or ``"none"`` when triton cannot be imported."""
    try:
        import triton
    except ImportError:
        return "none"
    return str(triton.__version__)


def source_hash(source: str) -> str:
    """Key of a kernel: hash of its source and the torch/triton versions (hex, 20 chars)."""
    digest = hashlib.sha256()
    for part in (source, torch.__version__, triton_version()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def content_hash(text: str) -> str:
    """SHA-256 (hex) of ``text`` as UTF-8: what a cached file must match."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def kernel_path(source: str, cache_dir: str | None) -> str:
    """Where the source file of a kernel lives in the cache."""
    return os.path.join(resolve_cache_dir(cache_dir), "kernels", f"k{source_hash(source)}.py")


def write_source(source: str, cache_dir: str | None) -> str:
    """Make the cache file of ``source`` hold exactly ``source``; return its path.

    An existing file whose content hash equals ``source``'s is kept; anything else there is
    replaced through a temporary file renamed into place (a concurrent reader never sees a
    half-written file). Raises OptionError when the cache directory is not private.
    """
    directory = private_dir(cache_dir, "kernels")
    path = os.path.join(directory, f"k{source_hash(source)}.py")
    problem = file_problem(path) if os.path.lexists(path) else "missing"
    found = read_text(path) if problem is None else None
    if found is not None and content_hash(found) == content_hash(source):
        return path
    if problem not in (None, "missing"):
        logger.warning("zeroc: kernel cache file %s is not trusted (%s); rewriting it", path,
                       problem)
    elif problem is None:
        logger.warning("zeroc: kernel cache file %s does not hold the source zeroc generated "
                       "for it (corrupt, or written by something else); rewriting it", path)
    atomic_write(path, source)
    return path


def load_module(source: str, cache_dir: str | None) -> types.ModuleType:
    """Import the module holding ``source`` (its cache file verified or rewritten first)."""
    key = source_hash(source)
    with _lock:
        module = _modules.get(key)
        if module is not None:
            return module
        path = write_source(source, cache_dir)
        name = f"zeroc_kernels.k{key}"
        module = types.ModuleType(name)
        module.__file__ = path
        # Run the text just verified, not the file again: what runs is what zeroc generated.
        # ``triton.jit`` reads the function's source back from ``path`` (equal to it).
        code = compile(source, path, "exec")
        sys.modules[name] = module
        try:
            exec(code, module.__dict__)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _modules[key] = module
        return module


def load_kernel(source: str, name: str, cache_dir: str | None):
    """The ``@triton.jit`` function called ``name`` defined by ``source``."""
    return getattr(load_module(source, cache_dir), name)
