"""Launch parameters of generated kernels, autotuned on a GPU and persisted.

On a GPU the first call of a kernel times a few block configurations with
``triton.testing.do_bench`` and keeps the fastest; the winner is stored in
``<cache_dir>/autotune/<source hash>.json`` (keyed by the problem size) so later processes
skip the search. On CPU (the Triton interpreter) the sizes are fixed and large: the
interpreter's cost grows with the number of program instances, not with their size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable

from zeroc.codegen.compile_cache import resolve_cache_dir
from zeroc.codegen.kernel_ir import KernelIR

INTERPRETER_TILE = 16384
GPU_MAX_TILE = 16384


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
    def from_json(data: dict[str, int]) -> LaunchConfig:
        """Inverse of :meth:`to_json`."""
        blocks = tuple((k, int(v)) for k, v in data.items() if k != "num_warps")
        return LaunchConfig(blocks, int(data.get("num_warps", 4)))


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
    """The block configurations tried on a GPU, most likely winner first."""
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
    """The configuration used before (or without) autotuning."""
    return gpu_candidates(ir)[0] if on_gpu else interpreter_config(ir)


def _store_path(cache_dir: str | None, key: str) -> str:
    return os.path.join(resolve_cache_dir(cache_dir), "autotune", f"{key}.json")


def problem_key(ir: KernelIR) -> str:
    """The size part of an autotune key."""
    return f"{ir.rows}x{ir.cols}"


def load_tuned(cache_dir: str | None, key: str, problem: str) -> LaunchConfig | None:
    """The persisted winner for kernel ``key`` at size ``problem``, if any."""
    path = _store_path(cache_dir, key)
    try:
        with open(path) as handle:
            table = json.load(handle)
    except (OSError, ValueError):
        return None
    entry = table.get(problem)
    return LaunchConfig.from_json(entry) if isinstance(entry, dict) else None


def save_tuned(cache_dir: str | None, key: str, problem: str, config: LaunchConfig) -> None:
    """Persist ``config`` as the winner for kernel ``key`` at size ``problem``."""
    path = _store_path(cache_dir, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path) as handle:
            table = json.load(handle)
    except (OSError, ValueError):
        table = {}
    table[problem] = config.to_json()
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(table, handle, indent=1, sort_keys=True)
    os.replace(tmp, path)


def autotune(ir: KernelIR, key: str, cache_dir: str | None,
             launch: Callable[[LaunchConfig], object]) -> LaunchConfig:
    """Time every GPU candidate with ``launch(config)``, persist and return the fastest.

    A configuration that fails to compile or run (e.g. too many registers) is skipped.
    """
    from triton.testing import do_bench

    problem = problem_key(ir)
    cached = load_tuned(cache_dir, key, problem)
    if cached is not None:
        return cached
    best: tuple[float, LaunchConfig] | None = None
    failures: list[str] = []
    for config in gpu_candidates(ir):
        try:
            ms = do_bench(lambda config=config: launch(config), warmup=5, rep=20)
        except Exception as exc:  # noqa: BLE001 - a config that cannot run is not a candidate
            failures.append(f"{config.to_json()}: {exc}")
            continue
        if best is None or ms < best[0]:
            best = (ms, config)
    if best is None:
        raise RuntimeError(f"kernel {ir.name}: no launch configuration ran: {failures}")
    save_tuned(cache_dir, key, problem, best[1])
    return best[1]
