"""zeroc's log lines (``TORCH_LOGS="zeroc"``) and its ``torch.profiler`` ranges.

The tiny GPT is compiled with zeroc on the CPU: at INFO each compiled graph gets one line
with its time and the passes' decisions, at DEBUG every pass's stats; progress lines reach
INFO on rank 0 only once a compile runs long (the threshold is set to 0 here). Under
``torch.profiler`` the graphs, fused kernels, per-step ZeRO buckets and, on two gloo ranks
with pp=2, every pipeline action show as ``zeroc/...`` events.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig

import zeroc
from zeroc.frontend import log_setup
from zeroc.runtime import executor
from zeroc.runtime.pipeline import zero as pipeline_zero
from zeroc.runtime.pipeline import zero_order as pipeline_zero_order
from zeroc.runtime.pipeline.zero import HoistedParam, StepZero, ZeroOrder
from zeroc.runtime.plan.records import PassInfo


class _Lines(logging.Handler):
    """Keeps (logger name, level, message) of every record it sees."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.name, record.levelno, record.getMessage()))


def capture_zeroc_logs(level: int) -> tuple[_Lines, Callable[[], None]]:
    """Attach a handler to the ``zeroc`` logger at ``level``; returns it and an undo."""
    logger = logging.getLogger("zeroc")
    handler, old_level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(level)

    def undo() -> None:
        logger.removeHandler(handler)
        logger.setLevel(old_level)

    return handler, undo


def train_step_tiny_gpt() -> None:
    model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=0), zero=3)
    # The fused head on (its logits are below "auto"'s size), so its log line is checked.
    compiled = torch.compile(model, backend="zeroc", options={"fused_loss": True})
    tokens, targets = model.example_batch(batch_size=2, seed=0)
    compiled(tokens, targets).backward()


def event_names(prof: torch.profiler.profile) -> set[str]:
    return {e.name for e in prof.events() if e.name.startswith("zeroc/")}


def test_env_level_reads_torch_logs() -> None:
    assert log_setup.env_level("zeroc") == logging.INFO
    assert log_setup.env_level("dynamo, +zeroc") == logging.DEBUG
    assert log_setup.env_level("-zeroc") == logging.ERROR
    assert log_setup.env_level("+zeroc,zeroc") == logging.INFO
    assert log_setup.env_level("zeroc.passes,dynamo") is None
    assert log_setup.env_level(None) is None


def test_decisions_summarise_pass_stats() -> None:
    def info(name: str, **stats: int) -> PassInfo:
        return PassInfo(pass_name=name, graph="g0.forward", changed=True, nodes_before=1,
                        nodes_after=1, before="", after="",
                        stats=tuple((k, str(v)) for k, v in stats.items()))

    text = log_setup.decisions([
        info("lower_zero", gather_buckets=2, reduce_buckets=0, whole_params=0),
        info("fusion", kernels=3, fused_ops=7), info("fusion", kernels=1, fused_ops=2)])
    assert text == "ZeRO buckets: 2 gathers, 0 reductions; 4 fused kernels (9 ops)"
    assert log_setup.decisions([info("eliminate_dead_code", removed=0)]) == "no changes"


def test_progress_is_info_on_rank_zero_only_after_the_threshold(monkeypatch) -> None:
    logger = logging.getLogger("zeroc.test_progress")
    handler, undo = capture_zeroc_logs(logging.DEBUG)
    try:
        monkeypatch.setattr(log_setup, "PROGRESS_AFTER_S", 1e9)
        log_setup.CompileProgress(logger, "g7").step("stage %d of %d", 1, 2)
        monkeypatch.setattr(log_setup, "PROGRESS_AFTER_S", 0.0)
        log_setup.CompileProgress(logger, "g7").step("stage %d of %d", 2, 2)
        monkeypatch.setattr(log_setup, "is_rank_zero", lambda: False)
        log_setup.CompileProgress(logger, "g7").step("stage %d of %d", 2, 2)
    finally:
        undo()
    levels = [(level, message.split(",")[0]) for _, level, message in handler.lines]
    assert levels == [(logging.DEBUG, "zeroc: g7: compiling stage 1 of 2"),
                      (logging.INFO, "zeroc: g7: compiling stage 2 of 2"),
                      (logging.DEBUG, "zeroc: g7: compiling stage 2 of 2")]


def test_compile_logs_one_info_line_per_graph_and_pass_stats(monkeypatch) -> None:
    monkeypatch.setattr(log_setup, "PROGRESS_AFTER_S", 0.0)
    handler, undo = capture_zeroc_logs(logging.DEBUG)
    try:
        train_step_tiny_gpt()
    finally:
        undo()
    assert all(name == "zeroc" or name.startswith("zeroc.") for name, _, _ in handler.lines)
    info = [m for name, level, m in handler.lines
            if level == logging.INFO and name == "zeroc.frontend.capture"]
    compiled = [m for m in info if " compiled in " in m]
    assert [m.split(" compiled in ")[0] for m in compiled] == [
        "zeroc: g0.forward", "zeroc: g0.backward"]
    assert "graph 1 of 2" in compiled[0] and "graph 2 of 2" in compiled[1]
    assert "fused LM-head loss" in compiled[0] and "fused kernels" in compiled[0]
    assert "fused kernels" in compiled[1]
    assert [m.split(",")[0] for m in info if "compiling" in m] == [
        "zeroc: g0: compiling the forward", "zeroc: g0: compiling the backward"]
    passes = [m for name, level, m in handler.lines
              if level == logging.DEBUG and name == "zeroc.passes.base"]
    for graph in ("g0.dynamo", "g0.joint", "g0.forward", "g0.backward"):
        assert any(m.startswith(f"zeroc: {graph}: pass ") for m in passes), graph
    assert any("pass fusion changed" in m and "kernels=" in m for m in passes)


def test_torch_logs_env_turns_zeroc_info_on() -> None:
    code = ("import logging, zeroc; log = logging.getLogger('zeroc.frontend.capture'); "
            "log.info('zeroc-info-line'); log.debug('zeroc-debug-line')")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    shown = subprocess.run([sys.executable, "-c", code], env={**env, "TORCH_LOGS": "zeroc"},
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "zeroc-info-line" in shown.stderr and "zeroc-debug-line" not in shown.stderr
    # Without TORCH_LOGS (this process), zeroc leaves its loggers to the application.
    assert "TORCH_LOGS" not in os.environ or log_setup.env_level(os.environ["TORCH_LOGS"]) is None
    assert not logging.getLogger("zeroc").isEnabledFor(logging.INFO)


def test_record_is_a_shared_no_op_without_a_profiler() -> None:
    assert not executor.profiling()
    assert executor.record("zeroc/x") is executor.record("zeroc/y")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert executor.profiling()
        assert isinstance(executor.record("zeroc/x"), torch.profiler.record_function)


def test_profiler_shows_graphs_and_fused_kernels() -> None:
    model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=0), zero=3)
    # The fused head on (its logits are below "auto"'s size), so its log line is checked.
    compiled = torch.compile(model, backend="zeroc", options={"fused_loss": True})
    tokens, targets = model.example_batch(batch_size=2, seed=0)
    compiled(tokens, targets).backward()  # compiles outside the trace
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(tokens, targets).backward()
    names = event_names(prof)
    assert {"zeroc/g0.forward", "zeroc/g0.backward"} <= names
    assert any(n.startswith("zeroc/zeroc_poi_") or n.startswith("zeroc/zeroc_red_")
               for n in names), names


def test_profiler_shows_per_step_zero_buckets(monkeypatch) -> None:
    # Two data-parallel ranks, faked: the collectives fill their outputs locally.
    monkeypatch.setattr(pipeline_zero, "group_size", lambda name: 2)
    monkeypatch.setattr(pipeline_zero_order, "group_size", lambda name: 2)
    monkeypatch.setattr(pipeline_zero, "resolve_group", lambda name: None)
    done = type("Done", (), {"wait": lambda self: None})()
    monkeypatch.setattr(pipeline_zero, "all_gather_single",
                        lambda out, inp, group=None, async_op=False: (
                            out.copy_(inp.repeat(2)), done)[1])
    monkeypatch.setattr(pipeline_zero, "reduce_scatter_single",
                        lambda out, inp, op=None, group=None, async_op=False: (
                            out.copy_(inp.view(2, -1).sum(0)), done)[1])
    hoisted = {i: HoistedParam(index=i, name=f"w{i}", shape=(4,), numel=4, group_name="dp",
                               zero_stage=3, param_dtype=None, reduce_dtype=None)
               for i in (0, 1)}
    order = ZeroOrder(gathers=((0, (0, 1)),), reduces={3: (0, (0, 1))})
    zero = StepZero(hoisted, {True: order, False: order}, bucket_mb=25.0)
    inputs = [torch.arange(2.0), torch.arange(2.0) + 10]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        zero.begin(inputs)
        zero.gather(0, inputs)
        grads = {0: torch.ones(4), 1: torch.full((4,), 3.0)}
        zero.reduce_ready(3, grads, inputs)
        zero.reduce(grads, inputs)
        zero.end()
    assert zero.counts == {"all_gather": 1, "reduce": 1}
    assert torch.equal(grads[1], torch.full((2,), 3.0))  # summed over 2 ranks, averaged
    assert {"zeroc/step_gather_s0_0", "zeroc/step_reduce_s0_0"} <= event_names(prof)


def pipeline_job(rank: int, world: int) -> dict:
    torch._dynamo.reset()
    log_setup.PROGRESS_AFTER_S = 0.0
    handler, undo = capture_zeroc_logs(logging.INFO)
    model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=0), zero=3, pp=2)
    compiled = torch.compile(model, backend="zeroc", options={"schedule": "1f1b"})
    tokens, targets = model.example_batch(batch_size=2, seed=0)
    compiled(tokens, targets).backward()
    undo()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(tokens, targets).backward()
    return {"events": sorted(event_names(prof)), "logs": [m for _, _, m in handler.lines]}


@pytest.mark.slow
def test_pipeline_actions_are_profiled_on_both_ranks() -> None:
    results = run_ranks(pipeline_job, 2, timeout=300)
    for rank, result in enumerate(results):
        events = set(result["events"])
        assert {"zeroc/pipeline_step", "zeroc/step_sync", f"zeroc/F0@s{rank}",
                f"zeroc/F1@s{rank}", f"zeroc/B0@s{rank}"} <= events, (rank, events)
        assert any(n.startswith("zeroc/SEND_") for n in events), events
        summary = [m for m in result["logs"] if "compiled in" in m]
        assert len(summary) == 1 and "pipeline of 2 stages" in summary[0], result["logs"]
        assert f"s{rank} on this rank" in summary[0] and "schedule 1f1b" in summary[0]
        progress = [m for m in result["logs"] if "compiling stage" in m]
        assert len(progress) == (1 if rank == 0 else 0), result["logs"]
