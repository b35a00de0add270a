"""The kernel compile cache: generated Triton source on disk, imported as a module.

``@triton.jit`` reads the source of the function it decorates, so every generated kernel is
written to a real ``.py`` file under ``<cache_dir>/kernels/`` named by a hash of the source and
the torch and triton versions, then imported with importlib. A module is imported once per
process; a file already on disk is reused, never rewritten.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
import types

import torch

DEFAULT_CACHE_DIR = "~/.cache/zeroc"

_modules: dict[str, types.ModuleType] = {}
_lock = threading.Lock()


def resolve_cache_dir(cache_dir: str | None) -> str:
    """The absolute cache directory (``~`` expanded); ``None`` means the default."""
    return os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR))


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


def kernel_path(source: str, cache_dir: str | None) -> str:
    """Where the source file of a kernel lives in the cache."""
    return os.path.join(resolve_cache_dir(cache_dir), "kernels", f"k{source_hash(source)}.py")


def write_source(source: str, cache_dir: str | None) -> str:
    """Write ``source`` to its cache file if it is not there yet; return the path.

    Writes go to a temporary file in the same directory and are renamed into place, so a
    concurrent reader never sees a half-written file.
    """
    path = kernel_path(source, cache_dir)
    if os.path.exists(path):
        return path
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(source)
    os.replace(tmp, path)
    return path


def load_module(source: str, cache_dir: str | None) -> types.ModuleType:
    """Import the module holding ``source`` (writing its file first when needed)."""
    key = source_hash(source)
    with _lock:
        module = _modules.get(key)
        if module is not None:
            return module
        path = write_source(source, cache_dir)
        name = f"zeroc_kernels.k{key}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import generated kernel module from {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _modules[key] = module
        return module


def load_kernel(source: str, name: str, cache_dir: str | None):
    """The ``@triton.jit`` function called ``name`` defined by ``source``."""
    return getattr(load_module(source, cache_dir), name)
