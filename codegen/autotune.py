"""Launch parameters of generated kernels: one default, or autotuned on a GPU and persisted.

Which configuration a kernel launches with (:func:`choose_config`):

* off a GPU (the Triton interpreter on CPU) the fixed :func:`interpreter_config`: large tiles,
  since the interpreter's cost grows with the number of program instances, not their size;
* on a GPU with ``kernel_autotune=False`` (the default) the first of :func:`gpu_candidates`,
  with no timing at all;
* on a GPU with ``kernel_autotune=True`` (or ``mode="max-autotune"``) the fastest candidate,
  timed once with ``triton.testing.do_bench`` (:func:`benchmark`) and persisted.

A tuned winner is stored under a :class:`TuneKey`: the kernel's source hash (which includes the
torch and triton versions), the GPU's name, the kernel's input and output dtypes, and its
*shape class*: the power-of-two bucket of the problem, ``n<next_pow2(numel)>`` for a pointwise
kernel and ``r<next_pow2(rows)>c<next_pow2(cols)>`` for a reduction. All problems of one class
have the same candidate list (the tiles depend only on those powers of two), so a winner is
valid, and close to best, for every size of its class: a new batch size or sequence length
in the same bucket reuses it without timing.

Records live in ``<cache_dir>/autotune/<hash of the key>.json``, written and read by
``zeroc.runtime.cached_files`` (the user's own file in private directories, a format version,
a checksum); a record is used only when its key equals the one looked up and its config is one
of this kernel's candidates. A corrupt, foreign or mismatching record is ignored with a
warning and replaced by the next tuning. Winners are also kept in memory per process
(:func:`clear_memory_cache` empties it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable

import torch

from zeroc.codegen.kernel_ir import KernelIR
from zeroc.runtime.cached_files import private_dir, read_record, resolve_cache_dir, write_record

logger = logging.getLogger(__name__)

INTERPRETER_TILE = 16384
GPU_MAX_TILE = 16384
RECORD_FORMAT = 2
RECORD_KIND = "autotune"

_memory: dict[TuneKey, LaunchConfig] = {}


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Block sizes (constexpr name, value) and warps of one launch."""

    blocks: tuple[tuple[str, int], ...]
    num_warps: int = 4

    def as_kwargs(self) -> dict[str, int]:
        """Keyword arguments for the kernel launch."""
        return dict(self.blocks)

    def to_json(self) -> dict[str, int]:
        """A flat JSON-able dict (blocks plus ``num_warps``)."""
        return {**dict(self.blocks), "num_warps": self.num_warps}

    @staticmethod
    def from_json(data: object) -> LaunchConfig:
        """Inverse of :meth:`to_json`; raises ValueError for anything else."""
        if not isinstance(data, dict) or not all(
                isinstance(k, str) and type(v) is int and v > 0 for k, v in data.items()):
            raise ValueError(f"launch config {data!r} is not a dict of positive ints")
        blocks = tuple((k, v) for k, v in data.items() if k != "num_warps")
        return LaunchConfig(blocks, data.get("num_warps", 4))


@dataclasses.dataclass(frozen=True)
class TuneKey:
    """What a tuned winner is valid for (see the module docstring)."""

    source_hash: str
    device: str
    dtypes: str
    shape_class: str

    def to_json(self) -> dict[str, str]:
        """The key as a JSON-able dict."""
        return dataclasses.asdict(self)

    def file_name(self) -> str:
        """The record's file name: a hash of the whole key."""
        text = json.dumps(self.to_json(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32] + ".json"


def grid(ir: KernelIR, config: LaunchConfig) -> tuple[int]:
    """Number of programs for ``ir`` launched with ``config``."""
    blocks = config.as_kwargs()
    if ir.kind == "pointwise":
        return (cdiv(ir.numel, blocks["BLOCK"]),)
    return (cdiv(ir.rows, blocks["BLOCK_R"]),)


def interpreter_config(ir: KernelIR) -> LaunchConfig:
    """Fixed, large tiles for the Triton interpreter on CPU."""
    if ir.kind == "pointwise":
        return LaunchConfig((("BLOCK", min(next_power_of_2(ir.numel),
                                           INTERPRETER_TILE)),))
    block_c = (next_power_of_2(ir.cols) if ir.persistent
               else min(1024, max(2, next_power_of_2(ir.cols) // 4)))
    block_r = min(next_power_of_2(ir.rows), max(1, INTERPRETER_TILE // block_c))
    return LaunchConfig((("BLOCK_R", block_r), ("BLOCK_C", block_c)))


def gpu_candidates(ir: KernelIR) -> list[LaunchConfig]:
    """The block configurations tried on a GPU, the default (most likely winner) first."""
    if ir.kind == "pointwise":
        return [LaunchConfig((("BLOCK", b),), w)
                for b, w in ((1024, 4), (512, 4), (2048, 8), (4096, 8))]
    if not ir.persistent:
        return [LaunchConfig((("BLOCK_R", 1), ("BLOCK_C", c)), w)
                for c, w in ((2048, 8), (1024, 4), (4096, 8), (4096, 16))]
    block_c = next_power_of_2(ir.cols)
    configs = []
    block_r = 1
    while block_r * block_c <= GPU_MAX_TILE and block_r <= 32:
        tile = block_r * block_c
        warps = max(1, min(16, tile // 512))
        configs.append(LaunchConfig((("BLOCK_R", block_r), ("BLOCK_C", block_c)), warps))
        if warps < 16 and tile >= 2048:
            configs.append(LaunchConfig((("BLOCK_R", block_r), ("BLOCK_C", block_c)),
                                        warps * 2))
        if block_r >= next_power_of_2(ir.rows):
            break
        block_r *= 2
    return configs


def default_config(ir: KernelIR, on_gpu: bool) -> LaunchConfig:
    """The configuration launched without autotuning."""
    return gpu_candidates(ir)[0] if on_gpu else interpreter_config(ir)


def is_gpu(device: torch.device) -> bool:
    """Whether kernels on ``device`` run on a GPU (anything else runs in the interpreter)."""
    return device.type == "cuda"


def device_name(device: torch.device) -> str:
    """The GPU's name (e.g. ``"NVIDIA H100 80GB HBM3"``), part of every tuning key."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def shape_class(ir: KernelIR) -> str:
    """The power-of-two bucket of ``ir``'s problem size (see the module docstring)."""
    if ir.kind == "pointwise":
        return f"n{next_power_of_2(ir.numel)}"
    return f"r{next_power_of_2(ir.rows)}c{next_power_of_2(ir.cols)}"


def tune_key(ir: KernelIR, source_hash: str, device: torch.device) -> TuneKey:
    """The key of ``ir``'s tuned winner on ``device``."""
    dtypes = (",".join(s.dtype for s in ir.inputs) + "->"
              + ",".join(s.dtype for s in ir.outputs))
    return TuneKey(source_hash, device_name(device), dtypes, shape_class(ir))


def clear_memory_cache() -> None:
    """Forget the winners found or read in this process (the records on disk stay)."""
    _memory.clear()


def _record_path(cache_dir: str | None, key: TuneKey) -> str:
    return os.path.join(private_dir(cache_dir, "autotune"), key.file_name())


def _check_record(ir: KernelIR) -> Callable[[object], LaunchConfig]:
    def check(data: object) -> LaunchConfig:
        config = LaunchConfig.from_json(data)
        if config not in gpu_candidates(ir):
            raise ValueError(f"config {config.to_json()} is not a candidate of this kernel")
        return config

    return check


def load_tuned(cache_dir: str | None, key: TuneKey, ir: KernelIR) -> LaunchConfig | None:
    """The winner for ``key``: from memory, else from its record when that is valid."""
    if key in _memory:
        return _memory[key]
    path = _record_path(cache_dir, key)
    config = read_record(path, RECORD_KIND, RECORD_FORMAT, key.to_json(), _check_record(ir),
                         what="autotune record", log=logger, root=resolve_cache_dir(cache_dir),
                         action="it will be replaced", max_bytes=1 << 16)
    if config is not None:
        _memory[key] = config
    return config


def save_tuned(cache_dir: str | None, key: TuneKey, config: LaunchConfig) -> str:
    """Persist ``config`` as the winner for ``key`` (atomically); return the record's path."""
    path = _record_path(cache_dir, key)
    write_record(resolve_cache_dir(cache_dir), path, RECORD_KIND, RECORD_FORMAT, key.to_json(),
                 config.to_json())
    _memory[key] = config
    return path


def benchmark(fn: Callable[[], object]) -> float:
    """Milliseconds one call of ``fn`` takes on the GPU (``triton.testing.do_bench``)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=20))


def autotune(ir: KernelIR, key: TuneKey, cache_dir: str | None,
             launch: Callable[[LaunchConfig], object]) -> LaunchConfig:
    """The winner for ``key``: persisted, or found by timing every GPU candidate with
    ``launch(config)`` and then persisted.

    A configuration that fails to compile or run (e.g. too many registers) is skipped.
    """
    cached = load_tuned(cache_dir, key, ir)
    if cached is not None:
        return cached
    best: tuple[float, LaunchConfig] | None = None
    failures: list[str] = []
    for config in gpu_candidates(ir):
        try:
            ms = benchmark(lambda config=config: launch(config))
        except Exception as exc:  # noqa: BLE001 - a config that cannot run is not a candidate
            failures.append(f"{config.to_json()}: {exc}")
            continue
        if best is None or ms < best[0]:
            best = (ms, config)
    if best is None:
        raise RuntimeError(f"kernel {ir.name}: no launch configuration ran: {failures}")
    path = save_tuned(cache_dir, key, best[1])
    logger.info("zeroc autotune: %s %s -> %s (%.4f ms), saved to %s", ir.name, key.shape_class,
                best[1].to_json(), best[0], path)
    return best[1]


def choose_config(ir: KernelIR, device: torch.device, tune: bool, key: TuneKey | None,
                  cache_dir: str | None,
                  launch: Callable[[LaunchConfig], object]) -> LaunchConfig:
    """The configuration a kernel launches with on ``device`` (the rules of the module
    docstring); ``tune`` is the ``kernel_autotune`` option, ``key`` its tuning key."""
    if not is_gpu(device):
        return interpreter_config(ir)
    if not tune or key is None:
        return default_config(ir, on_gpu=True)
    return autotune(ir, key, cache_dir, launch)
