"""Sections ``collectives`` and ``pipeline``: zeroc's distributed code paths on one device.

One GPU cannot run two NCCL ranks (NCCL refuses two ranks on one device), and on a world-1
group zeroc issues no collective at all (a group of one rank: ZeRO-3's gathers and reductions
only reshape). So each section runs the paths another way:

- ``collectives``: the world-1 group (NCCL on a GPU, gloo on the CPU) with zeroc told to keep
  its collectives (``kept_collectives``: the mesh names the one-rank data-parallel group, as it
  names a larger one, and ``zeroc.passes.zero_buckets.COLLECTIVE_MIN_RANKS`` is 1, so its ZeRO marks
  are lowered like any group's). ZeRO-3 then gathers every parameter with
  ``all_gather_into_tensor(_coalesced)`` and reduce-scatters every gradient (gloo: the
  all-to-all zeroc uses there), each collective moving what a group of one moves, which is
  exactly the data: the losses must agree with eager's (the training section's tolerance;
  quantized ones within ``QUANT_TOLERANCE``). Three models, each trained for
  ``--probe-steps`` steps: ``zero3``, ``quantized`` (``gather_quant="int8"``,
  ``reduce_quant="int8"``: the quantize kernels, the int8 all-gather, the all-to-all of
  quantized rows) and ``offload``
  (``offload="optimizer"``: pinned host rows, the gradients copied out as their reductions
  complete, the updated rows copied back on a side stream). Per model: losses against eager's
  (``probe``'s eager run), the collectives its plan lists (``zeroc.explain``: op and dtype,
  which must include gathers and reductions, int8 ones when quantized) and, on CUDA, the host
  synchronizations of steps 3-5 (``torch.cuda.set_sync_debug_mode``).
- ``pipeline``: a pp = 2 DualPipeV pipeline (4 micro-batches, ZeRO-3; the model's width, at
  least 4 blocks, the batch rounded up to a multiple of 4) whose two positions run
  one after the other in a child process (``gpu_checks.pipeline_run``) on this one device,
  each as its rank of a world-2 group of torch's ``fake`` backend: the stage programs compile
  and run for real (Inductor on CUDA), the executor, the step's closing all-gather with its
  CUDA events and the step clock run as in a job, while no transfer moves data (a receive
  leaves its buffer as it was; a collective hands back this rank's own data), so the values
  are not checked, only that the steps run and where the host waits: zeroc's own
  ``count_host_syncs`` over steps 3-5 must find nothing but ``read_rows``'s one wait per call
  (README: a pipelined call waits only while the device still runs the previous one).

These are switches of the check alone: nothing in zeroc changes for any other run.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from models.gpt import GPT

from . import flops
from .probe import SYNC_STEPS, SyncCounter, ensure_group, probe
from .runner import Budget, SkipSection, release_memory, synchronize
from .train import compare_losses

logger = logging.getLogger(__name__)

MODELS = {"zero3": ({}, None),
          "quantized": ({"gather_quant": "int8", "reduce_quant": "int8"}, None),
          "offload": ({}, "optimizer")}
# Losses of int8 gathers and reductions (with error feedback) against eager's: rtol, atol.
QUANT_TOLERANCE = (5e-2, 5e-2)
PIPELINE_CHILD_S = 600  # at most, whatever the budget: the child is stopped after this


@contextlib.contextmanager
def kept_collectives(device_type: str) -> Iterator[None]:
    """While inside, a model parallelized on a one-rank data-parallel group keeps zeroc's
    collectives: the mesh names that group (``dp_group_name``, ``""`` at dp = 1 otherwise)
    and the ZeRO pass lowers marks over groups of one rank. The built mesh is not cached
    beyond the block."""
    import zeroc.passes.zero_buckets as zero_pass
    from zeroc.runtime import mesh as mesh_module

    original, minimum = mesh_module._from_device_mesh, zero_pass.COLLECTIVE_MIN_RANKS

    def named(*args: Any, **kwargs: Any) -> Any:
        built = original(*args, **kwargs)
        if built.dp == 1 and not built.dp_group_name and built.dp_device_mesh is not None:
            group = built.dp_device_mesh.get_group()
            built = dataclasses.replace(built, dp_group_name=group.group_name)
        return built

    mesh_module._MESH_CACHE.pop((1, device_type), None)  # built again, with the group named
    mesh_module._from_device_mesh, zero_pass.COLLECTIVE_MIN_RANKS = named, 1
    try:
        yield
    finally:
        mesh_module._from_device_mesh, zero_pass.COLLECTIVE_MIN_RANKS = original, minimum
        mesh_module._MESH_CACHE.pop((1, device_type), None)


def collective_counts(collectives: Any) -> dict[str, int]:
    """``{"all_gather int8": 2, "reduce_scatter float32": 3, ...}`` of a plan's collectives."""
    return dict(collections.Counter(f"{c.op} {c.dtype}".strip() for c in collectives))


def check_counts(counts: dict[str, int], quantized: bool) -> str | None:
    """Why the collectives a kept model compiled are not what it must issue (``None``: they
    are): gathers and reductions, int8 ones of both when ``quantized``."""
    gathers = [k for k in counts if k.split()[0] == "all_gather"]
    reductions = [k for k in counts if k.split()[0] in ("reduce_scatter", "all_to_all",
                                                       "all_reduce")]
    if not gathers or not reductions:
        return f"no gathers or no reductions among {counts}"
    for kind, keys in (("gathers", gathers), ("reductions", reductions)):
        if quantized and not any(k.endswith(" int8") for k in keys):
            return f"the {kind} are not int8: {counts}"
    return None


def run_kept(ctx: Any, name: str) -> dict[str, Any]:
    """Train model ``name`` of ``MODELS`` with its collectives kept; its figures."""
    import zeroc

    options, offload = MODELS[name]
    cuda = ctx.device.startswith("cuda")
    group = ensure_group(ctx)
    tokens, targets = ctx.batch_tensors()
    release_memory()
    with kept_collectives(ctx.device.split(":")[0]):
        model = GPT(ctx.model, seed=0).to(ctx.device)
        policy, amp = None, lambda: flops.autocast(ctx.device, ctx.dtype)
        if ctx.dtype != torch.float32 and ctx.zero3_precision == "mixed":  # as probe's zero3
            policy, amp = zeroc.MixedPrecision(param_dtype=ctx.dtype), contextlib.nullcontext
        zeroc.parallelize(model, zero=3, mixed_precision=policy, offload=offload)
        compiled = torch.compile(model, backend="zeroc", options={
            **options, "cache_dir": os.path.join(ctx.cache_dir, "zeroc")})
        optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.lr)
        losses, step_s, syncs = [], [], {}
        for step in range(ctx.probe_steps):
            synchronize(ctx.device)
            start = time.perf_counter()
            with SyncCounter(cuda and step in SYNC_STEPS) as counter:
                with amp():
                    loss = compiled(tokens, targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            synchronize(ctx.device)
            step_s.append(time.perf_counter() - start)
            losses.append(loss.detach())
            if counter.result is not None:
                syncs[str(step)] = counter.result
        counts = collective_counts(zeroc.explain(compiled).collectives)
    return {"process_group": group, "options": options, "offload": offload,
            "losses": [float(v.float()) for v in losses], "step_s": step_s,
            "collectives": counts, "syncs": syncs}


def run_collectives(ctx: Any, budget: Budget) -> dict[str, Any]:
    """The ``collectives`` section."""
    eager = probe(ctx, "eager", budget)
    models: dict[str, Any] = {}
    problems = []
    for name in MODELS:
        if budget.spent():
            models[name] = {"skipped": "budget spent"}
            continue
        try:
            figures = run_kept(ctx, name)
        except Exception as error:  # recorded; the other models still run
            logger.error("collectives: %s failed", name, exc_info=True)
            models[name] = {"error": f"{type(error).__name__}: {error}"}
            problems.append(f"{name} failed ({type(error).__name__}: {error})")
            continue
        quantized = bool(figures["options"])
        comparison = compare_losses(figures["losses"], eager.losses, ctx.dtype)
        if quantized:
            comparison = quant_comparison(figures["losses"], eager.losses)
        figures["loss_comparison"] = comparison
        wrong = check_counts(figures["collectives"], quantized)
        if wrong:
            problems.append(f"{name}: {wrong}")
        if not comparison["agree"]:
            problems.append(f"{name}'s losses disagree with eager's ({comparison['reason']})")
        models[name] = figures
        logger.info("collectives: %s: %s; losses agree: %s", name, figures["collectives"],
                    comparison["agree"])
    return {"ok": not problems, "reason": "; ".join(problems) or None,
            "eager_losses": eager.losses, "quant_tolerance": QUANT_TOLERANCE,
            "models": models}


def quant_comparison(losses: list[float], reference: list[float]) -> dict[str, Any]:
    """``compare_losses`` with ``QUANT_TOLERANCE`` (int8 weights and gradients)."""
    rtol, atol = QUANT_TOLERANCE
    if not reference or len(losses) != len(reference):
        return {"agree": False, "reason": f"{len(losses)} losses against {len(reference or [])}"}
    diffs = [abs(a - b) for a, b in zip(losses, reference, strict=True)]
    agree = all(d <= rtol * abs(b) + atol for d, b in zip(diffs, reference, strict=True))
    agree = agree and all(v == v and abs(v) != float("inf") for v in losses)
    return {"agree": agree, "max_abs_diff": max(diffs), "reason": None if agree
            else "outside the quantized tolerance or not finite"}


def pipeline_figures(result: dict[str, Any]) -> dict[str, Any]:
    """Whether the child's positions ran every step and waited only where README says."""
    problems = []
    for position in result.get("positions", []):
        where = f"position {position['position']}"
        if position.get("error"):
            problems.append(f"{where} failed ({position['error']})")
            continue
        if len(position["step_s"]) < result["steps"]:
            problems.append(f"{where} ran {len(position['step_s'])} of {result['steps']} steps")
        for step, syncs in position["syncs"].items():
            other = [s for s in syncs if "(read_rows)" not in s["site"]]
            if other or len(syncs) > 1:
                problems.append(f"{where} step {step} waited for the device at {syncs}")
    if not result.get("positions"):
        problems.append(f"no position ran ({result.get('error')})")
    return {"ok": not problems, "reason": "; ".join(problems) or None, **result}


def run_pipeline(ctx: Any, budget: Budget) -> dict[str, Any]:
    """The ``pipeline`` section: ``gpu_checks.pipeline_run`` in a child process."""
    from . import BENCHMARKS

    out = os.path.join(ctx.cache_dir, "pipeline_run.json")
    with contextlib.suppress(FileNotFoundError):
        os.remove(out)  # an earlier run's, in a --cache-dir used again
    cfg = ctx.model
    batch = -(-max(ctx.batch, 4) // 4) * 4  # the pipeline's 4 micro-batches divide it
    command = [sys.executable, "-m", "gpu_checks.pipeline_run", "--json", out,
               "--device", ctx.device, "--dtype", str(ctx.dtype).removeprefix("torch."),
               "--precision", ctx.zero3_precision,
               "--d-model", str(cfg.d_model), "--n-layer", str(max(cfg.n_layer, 4)),
               "--n-head", str(cfg.n_head), "--seq", str(cfg.block_size),
               "--vocab", str(cfg.vocab_size), "--batch", str(batch),
               "--steps", str(ctx.probe_steps), "--cache-dir", ctx.cache_dir]
    timeout = min(PIPELINE_CHILD_S, max(budget.left(), 30.0)) if budget.seconds > 0 else (
        PIPELINE_CHILD_S)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [BENCHMARKS, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        done = subprocess.run(command, cwd=BENCHMARKS, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SkipSection(f"the pipeline child did not finish within {timeout:.0f} s") from None
    if not os.path.exists(out):
        raise RuntimeError(f"the pipeline child wrote no result (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    with open(out) as handle:
        result = json.load(handle)
    result["exit_code"] = done.returncode
    figures = pipeline_figures(result)
    logger.info("pipeline: %s", figures["reason"] or "every step ran; waits as documented")
    return figures
