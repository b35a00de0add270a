"""The sections of ``benchmarks/gpu_check.py``: what one GPU can check unattended.

- ``runner``: the overall and per-section time budgets, skipping, failure capture, the JSON;
- ``flops``: FLOPs per step (``FlopCounterMode``), the device's peak FLOP/s, MFU;
- ``train``: section ``train``, the zoo GPT's training step as eager, Inductor and zeroc
  (step time medians over interleaved rounds, ratios, tokens/s, MFU, losses against eager's);
- ``kernels``: sections ``kernels`` (zeroc's Triton kernels against Inductor's on the same
  fused groups, from ``benchmarks/gpu_kernels.py``) and ``fused_loss`` (``zeroc::
  linear_cross_entropy`` against eager ``F.cross_entropy(lm_head(h))``);
- ``probe``: instrumented zeroc training runs and the sections built on them: ``zero3``
  (ZeRO-3 on a world-1 NCCL group against eager), ``memory`` (measured peak against the
  plan's) and ``syncs`` (host synchronizations per steady step);
- ``paths``: sections ``collectives`` (ZeRO-3, quantized collectives and optimizer offload
  on the world-1 group with zeroc's collectives kept, against eager) and ``pipeline`` (a
  pp = 2 DualPipeV pipeline's compiled stages on this device, ``pipeline_run`` in a child
  process, and where its steps wait for the device).

Here: ``Context`` (what the sections measure, and the state they share), ``SECTIONS`` (in run
order, each with its budget) and ``headline`` (a section's main figure in a few words).
Importing the package puts ``benchmarks/`` and ``tests/`` on ``sys.path``: the sections use
``gpu_step`` and ``gpu_kernels`` beside it and the zoo GPT of ``tests/models``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(_HERE)
TESTS = os.path.join(os.path.dirname(BENCHMARKS), "tests")
for _path in (TESTS, BENCHMARKS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from models.gpt import GPTConfig, random_token_batch  # noqa: E402 -- needs the paths above

from .kernels import run_fused_loss, run_kernels  # noqa: E402
from .paths import run_collectives, run_pipeline  # noqa: E402
from .probe import run_memory, run_syncs, run_zero3  # noqa: E402
from .runner import Section  # noqa: E402
from .train import run_train  # noqa: E402


@dataclasses.dataclass
class Context:
    """What every section measures, and where; ``memo`` holds what sections share (the
    batch, the process group, the probes)."""

    device: str
    device_name: str | None
    dtype: torch.dtype
    model: GPTConfig
    batch: int
    steps: int
    warmup: int
    lr: float
    configs: tuple[str, ...]
    zero3_precision: str
    probe_steps: int
    kernel_rows: int
    kernel_cols: int
    cache_dir: str
    hardware: dict[str, Any]
    memo: dict[str, Any] = dataclasses.field(default_factory=dict)

    def batch_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The one training batch, on the device: ``GPT.example_batch(batch, seed=0)``'s,
        which ``gpu_step`` trains on too."""
        if "batch" not in self.memo:
            cfg = self.model
            tokens, targets = random_token_batch(cfg.vocab_size, cfg.block_size, self.batch,
                                                 None, 0)
            self.memo["batch"] = (tokens.to(self.device), targets.to(self.device))
        return self.memo["batch"]


# In run order; budgets in seconds (690 in all, so that the check ends within 13 minutes on an
# H100 or H200 with its start-up and a compile running past its section's budget; the new
# paths alone: --sections collectives,pipeline, about 5 minutes).
SECTIONS = (
    Section("train", run_train, 180, 60, needs_cuda=False,
            doc="eager, Inductor and zeroc training steps: ratios, tokens/s, MFU"),
    Section("kernels", run_kernels, 60, 20,
            doc="zeroc's Triton kernels against Inductor's on the same fused groups"),
    Section("fused_loss", run_fused_loss, 30, 10, needs_cuda=False,
            doc="zeroc::linear_cross_entropy against eager F.cross_entropy(lm_head(h))"),
    Section("zero3", run_zero3, 70, 30, needs_cuda=False,
            doc="ZeRO-3 on a world-1 process group against eager"),
    Section("memory", run_memory, 50, 15, needs_cuda=False,
            doc="measured peak memory against the plan's"),
    Section("syncs", run_syncs, 30, 10,
            doc="host synchronizations per steady step"),
    Section("collectives", run_collectives, 120, 30, needs_cuda=False,
            doc="ZeRO-3, quantized collectives and offload with the world-1 group's "
                "collectives kept, against eager"),
    Section("pipeline", run_pipeline, 150, 60, needs_cuda=False,
            doc="a pp=2 DualPipeV pipeline's compiled stages on this device, and its waits"),
)
SECTION_NAMES = tuple(s.name for s in SECTIONS)
TOTAL_BUDGET_S = sum(s.budget_s for s in SECTIONS)


def headline(name: str, record: dict[str, Any]) -> str:
    """A section's main figure in a few words ("" when there is none)."""
    f = record.get("figures") or {}

    def num(value: Any, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    if name == "train":
        z = f.get("variants", {}).get("zeroc", {})
        return (f"zeroc/eager {num(z.get('over_eager'), '.2f')}, zeroc/inductor "
                f"{num(z.get('over_inductor'), '.2f')}, MFU {num(z.get('mfu'), '.1%')}")
    if name == "kernels":
        return "; ".join(f"{d}: zeroc/inductor {num(s['zeroc_over_inductor_geomean'], '.2f')}"
                         for d, s in f.get("summary", {}).items())
    if name == "fused_loss":
        fused = f.get("variants", {}).get("fused", {})
        diffs = fused.get("max_abs_diff_vs_eager") or {}
        return (f"fused/eager {num(fused.get('time_over_eager'), '.2f')}, max |diff| vs eager "
                + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    if name == "zero3":
        return (f"losses agree: {f.get('loss_comparison', {}).get('agree')}, ZeRO-3/eager "
                f"{num(f.get('zero3_time_over_eager'), '.2f')}")
    if name == "memory":
        return ", ".join(f"{c}: measured/plan {num(m['measured_over_plan'], '.2f')}"
                         for c, m in f.get("configs", {}).items())
    if name == "syncs":
        return ", ".join(f"{c}: {s.get('per_step', s)}" for c, s in f.get("configs", {}).items())
    if name == "collectives":
        return ", ".join(f"{m}: {sum(r.get('collectives', {}).values())} collectives, losses "
                         f"agree {r.get('loss_comparison', {}).get('agree')}"
                         for m, r in f.get("models", {}).items())
    if name == "pipeline":
        return ", ".join(f"position {p['position']}: {len(p['step_s'])} steps, stages "
                         f"{p['stages']}" for p in f.get("positions", []))
    return ""
