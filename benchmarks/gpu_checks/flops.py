"""FLOPs of a training step, the device's peak FLOP/s, and the MFU they give.

Model FLOPs per step are counted by ``torch.utils.flop_counter.FlopCounterMode`` over one eager
forward and backward of the zoo GPT (attention is counted as SDPA's full, non-causal matmuls;
recomputation is not counted); the analytic ``6 * matmul parameters * tokens + 12 * layers *
width * seq * tokens`` is given beside it and used when the counter fails. The peak dense
FLOP/s for the compute dtype comes from ``--peak-tflops`` when given, else from zeroc's
hardware profile (``zeroc.runtime.cost.hardware``, data in ``runtime/cost/hardware_profiles.json``)
named
by ``--hardware`` or matched to ``torch.cuda.get_device_name()``; without one MFU is unknown
and the reason is recorded. ``mfu = FLOPs per step / step seconds / peak FLOP/s``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from models.gpt import GPT, GPTConfig

logger = logging.getLogger(__name__)


def autocast(device: str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``'s type; nothing in float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def analytic_flops(cfg: GPTConfig, batch: int) -> int:
    """``6 * matmul parameters * tokens`` (the tied head counted once, as the head) plus
    ``12 * layers * width * seq * tokens`` (attention scores and values, forward and backward,
    without the causal half skipped)."""
    width, layers = cfg.d_model, cfg.n_layer
    per_block = width * 3 * width + width * width + width * 4 * width * 2
    matmul_params = layers * per_block + width * cfg.vocab_size
    tokens = batch * cfg.block_size
    return 6 * matmul_params * tokens + 12 * layers * width * cfg.block_size * tokens


def count_flops(cfg: GPTConfig, device: str, dtype: torch.dtype, tokens: torch.Tensor,
                targets: torch.Tensor) -> dict[str, Any]:
    """FLOPs of one eager forward + backward counted by ``FlopCounterMode``: ``{"counted",
    "by_op", "error"}`` (``counted`` ``None`` and ``error`` set when counting fails)."""
    from torch.utils.flop_counter import FlopCounterMode

    result: dict[str, Any] = {"counted": None, "by_op": {}, "error": None}
    model = None
    try:
        model = GPT(cfg, seed=0).to(device)
        counter = FlopCounterMode(display=False)
        with counter:
            with autocast(device, dtype):
                loss = model(tokens, targets)
            loss.backward()
        result["counted"] = int(counter.get_total_flops())
        totals: dict[str, int] = {}
        for ops in counter.get_flop_counts().values():
            for op, flops in ops.items():
                totals[str(op)] = max(totals.get(str(op), 0), int(flops))
        result["by_op"] = dict(sorted(totals.items(), key=lambda kv: -kv[1]))
    except Exception as error:  # MFU then uses the analytic count
        result["error"] = f"{type(error).__name__}: {error}"
        logger.warning("FlopCounterMode failed, MFU uses the analytic count", exc_info=True)
    del model
    return result


def step_flops(cfg: GPTConfig, batch: int, counted: dict[str, Any]) -> dict[str, Any]:
    """The FLOPs per step MFU uses (the counted ones, else the analytic ones) and its basis."""
    analytic = analytic_flops(cfg, batch)
    if counted.get("counted"):
        basis = "FlopCounterMode over one eager forward + backward"
        if not any("attention" in op for op in counted.get("by_op", {})):
            basis += ", without attention (no counter formula for the SDPA kernel that ran)"
        used = counted["counted"]
    else:
        basis, used = "analytic 6 * matmul params * tokens + attention", analytic
    return {"used": used, "basis": basis, "counted": counted.get("counted"),
            "analytic": analytic, "counted_by_op": counted.get("by_op", {}),
            "counter_error": counted.get("error")}


def resolve_peak(hardware: str | None, device_name: str | None, dtype: torch.dtype,
                 peak_tflops: float | None = None) -> dict[str, Any]:
    """The peak dense FLOP/s for ``dtype`` and where it comes from, or why there is none.

    Returns ``{"name", "peak_flops", "memory_bytes_per_s", "source", "reason"}``;
    ``peak_flops`` is ``peak_tflops * 1e12`` when given, else the hardware profile's;
    ``None`` (and ``reason`` says why) when ``zeroc.runtime.cost.hardware`` cannot be imported,
    ``hardware`` is not a known profile, or ``device_name`` matches none. Never raises.
    """
    found: dict[str, Any] = {"name": None, "peak_flops": None, "memory_bytes_per_s": None,
                             "source": None, "reason": None}
    if peak_tflops is not None:
        found.update(name="--peak-tflops", peak_flops=float(peak_tflops) * 1e12,
                     source="--peak-tflops")
        return found
    try:
        from zeroc.runtime.cost.hardware import get_profile, profile_for_device_name
    except Exception as error:  # the module is optional here: MFU is then unknown
        found["reason"] = (f"zeroc.runtime.cost.hardware is not available ({type(error).__name__}: "
                           f"{error})")
        return found
    try:
        if hardware is not None:
            profile = get_profile(hardware)
        elif device_name is None:
            found["reason"] = ("no CUDA device name to look a profile up by; pass --hardware "
                               "NAME or --peak-tflops")
            return found
        else:
            profile = profile_for_device_name(device_name)
            if profile is None:
                found["reason"] = (f"no known hardware profile matches the device "
                                   f"{device_name!r}; pass --hardware NAME or --peak-tflops")
                return found
        found.update(name=profile.name, peak_flops=float(profile.flops_for(dtype)),
                     memory_bytes_per_s=float(profile.memory_bytes_per_s),
                     source=getattr(profile, "source", None))
    except Exception as error:  # a bad --hardware name or a profile without the figure
        found["reason"] = (f"no peak FLOP/s from the hardware profile ({type(error).__name__}: "
                           f"{error})")
    return found


def achieved_flops(flops_per_step: float | None, step_s: float | None) -> float | None:
    """FLOP/s of ``flops_per_step`` done every ``step_s`` seconds; ``None`` without both."""
    if not flops_per_step or not step_s or step_s <= 0:
        return None
    return flops_per_step / step_s


def mfu(flops_per_step: float | None, step_s: float | None, peak_flops: float | None
        ) -> float | None:
    """Model FLOPs utilization: ``flops_per_step / step_s / peak_flops`` (``None`` when any
    is missing or not positive)."""
    achieved = achieved_flops(flops_per_step, step_s)
    if achieved is None or not peak_flops or peak_flops <= 0:
        return None
    return achieved / peak_flops
