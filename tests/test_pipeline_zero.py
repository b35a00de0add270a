"""ZeRO inside a pipeline: parameters gathered and gradients reduced once per step.

On 4 gloo ranks (pp=2 x dp=2, ZeRO-3 and ZeRO-2, 1F1B with 4 micro-batches) the collectives
of the data-parallel group are counted in the second step: with the default
``pp_reshard=False`` each rank issues one all-gather and one reduce-scatter per bucket of its
stage, whatever the number of micro-batches; with ``pp_reshard=True`` the stage graphs gather
and reduce in every micro-batch. Both train to eager's numbers on the global batch.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from parity import ADAM, assert_tensors_match
from test_torch_distributed import batches, eager_run, make_gpt, rows
from torch.utils._python_dispatch import TorchDispatchMode

import zeroc

MICROBATCHES = 4


class CollectiveCount(TorchDispatchMode):
    """Counts gathers into one tensor and reductions (not the list all-gather of the step's
    loss and timings, nor p2p). On gloo zeroc reduce-scatters with an all-to-all."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"all_gather": 0, "reduce": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if "allgather_into_tensor" in name or "_allgather_base" in name or (
                "all_gather_into_tensor" in name):
            self.counts["all_gather"] += 1
        elif ("reduce_scatter" in name or "allreduce" in name or "all_reduce" in name
              or "alltoall" in name or "all_to_all" in name):  # gloo: zeroc's reduce-scatter
            if not name.startswith("_c10d_functional::wait"):
                self.counts["reduce"] += 1
        return func(*args, **(kwargs or {}))


def train_two_steps(compiled, optimizer, dp_index: int) -> list[float]:
    """Two AdamW steps on this data-parallel replica's rows; its losses."""
    losses = []
    for index in range(2):
        loss = compiled(*rows(batches()[index], dp_index, 2))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def counting_job(rank: int, world: int, zero: int, reshard: bool,
                 options: dict | None = None) -> dict:
    torch._dynamo.reset()
    model = zeroc.parallelize(make_gpt(), zero=zero, pp=2)
    compiled = torch.compile(model, backend="zeroc", options={
        "schedule": "1f1b", "microbatches": MICROBATCHES, "pp_reshard": reshard,
        **(options or {})})
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    dp_index = model._zeroc_layout.mesh.dp_index
    from zeroc.runtime.pipeline.executor import PipelineExecutor

    counters = []
    run = PipelineExecutor.run

    def counted_run(self, *args, **kwargs):  # the step, outside Dynamo's frame
        counters.append(CollectiveCount())
        with counters[-1]:
            return run(self, *args, **kwargs)

    PipelineExecutor.run = counted_run
    try:
        losses = train_two_steps(compiled, optimizer, dp_index)
    finally:
        PipelineExecutor.run = run
    counts = counters[-1].counts
    executor = compiled_executor(compiled)
    buckets = None
    if executor.zero is not None:
        buckets = executor.zero.counts
    plan = zeroc.explain(compiled)
    step_ops = sorted(c.op for c in plan.collectives if c.graph.endswith(".step"))
    step_gathers = [(c.dtype, c.bytes, c.params) for c in plan.collectives
                    if c.graph.endswith(".step") and c.op == "all_gather"]
    step_reduces = [(c.dtype, c.bytes, c.params) for c in plan.collectives
                    if c.graph.endswith(".step") and c.op == "reduce_scatter"]
    in_graphs = sorted(c.op for c in plan.collectives if not c.graph.endswith(".step"))
    return {"losses": losses, "counts": counts, "buckets": buckets, "step_ops": step_ops,
            "step_gathers": step_gathers, "step_reduces": step_reduces,
            "in_graphs": in_graphs, "plan": str(plan),
            "stages": len(executor.stages), "full": zeroc.full_state_dict(model)}


def compiled_executor(compiled):
    from zeroc.frontend.session import SESSION_ATTR, wrapper_of

    return getattr(wrapper_of(compiled), SESSION_ATTR).pipelined_executor()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero", [3, 2])
def test_zero_collectives_once_per_step_in_a_pipeline(zero: int) -> None:
    once = run_ranks(counting_job, 4, zero, False, timeout=400)
    every = run_ranks(counting_job, 4, zero, True, timeout=400)
    losses, _, reference = eager_run(range(2))
    for mode in (once, every):
        # Each data-parallel replica returns the loss of its rows; their mean is eager's.
        mean = [sum(r["losses"][i] for r in mode) / len(mode) for i in range(2)]
        assert mean == pytest.approx(losses, rel=1e-5)
        assert_tensors_match(reference.state_dict(), mode[0]["full"], f"zero={zero}")
    for result in once:
        # One bucket per stage (all parameters of a stage fit in 25 MiB): one gather and one
        # reduction per stage and step.
        assert result["buckets"] == {"all_gather": result["stages"], "reduce": result["stages"]}
        assert result["counts"] == result["buckets"]
        # The plan lists the step's buckets and no collective inside the stage graphs.
        assert result["step_ops"] == sorted(
            ["all_gather"] * result["stages"] + ["reduce_scatter"] * result["stages"])
        assert result["in_graphs"] == []
        assert ".step" in result["plan"]
    for result in every:
        assert result["step_ops"] == [] and "all_gather" in result["in_graphs"]
    for first, second in zip(once, every, strict=True):
        assert second["counts"]["reduce"] >= MICROBATCHES * first["counts"]["reduce"]
        assert second["counts"]["all_gather"] >= MICROBATCHES * first["counts"]["all_gather"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quantized_collectives_once_per_step_in_a_pipeline() -> None:
    """``gather_quant="int8"`` and ``reduce_quant="int4"`` in a pipeline's per-step
    collectives (pp=2 x dp=2, ZeRO-3): the same one gather and one reduction per stage, the
    gathers int8 and the reductions int4 with their packed buffers' bytes, the losses within
    the quantization's reach of eager's."""
    from zeroc.runtime.quant.gather import BLOCK, quantized_bytes
    from zeroc.runtime.quant.reduce import row_bytes

    got = run_ranks(counting_job, 4, 3, False, {"gather_quant": "int8", "reduce_quant": "int4"},
                    timeout=400)
    losses, _, _ = eager_run(range(2))
    mean = [sum(r["losses"][i] for r in got) / len(got) for i in range(2)]
    assert mean == pytest.approx(losses, rel=1e-3) and mean != pytest.approx(losses, rel=1e-7)
    shapes = {n: p.shape for n, p in make_gpt().named_parameters()}
    for result in got:
        assert result["counts"] == result["buckets"] == {"all_gather": result["stages"],
                                                         "reduce": result["stages"]}
        for dtype, nbytes, params in result["step_gathers"]:
            numel = sum(-(-shapes[n][0] // 2) * shapes[n][1:].numel() for n in params)
            assert dtype == "int8" and nbytes == quantized_bytes(numel, 2)
        assert len(result["step_reduces"]) == result["stages"]
        for dtype, nbytes, params in result["step_reduces"]:
            numel = sum(-(-shapes[n][0] // 2) * shapes[n][1:].numel() for n in params)
            assert dtype == "int4" and nbytes == 2 * row_bytes(numel, 4, BLOCK)


def training_job(rank: int, world: int, zero: int) -> dict:
    torch._dynamo.reset()
    model = zeroc.parallelize(make_gpt(), zero=zero, pp=2)
    compiled = torch.compile(model, backend="zeroc", options={
        "schedule": "1f1b", "microbatches": MICROBATCHES})
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    dp_index = model._zeroc_layout.mesh.dp_index
    losses = train_two_steps(compiled, optimizer, dp_index)
    held = sum(s.flat.untyped_storage().nbytes() for s in model._zeroc_state.params)
    return {"losses": losses, "held": held, "full": zeroc.full_state_dict(model)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero1_in_a_pipeline_trains_to_eager_holding_only_its_stages() -> None:
    """ZeRO-1 refreshes whole parameters from every rank's rows after the optimizer step;
    in a pipeline it must skip those another stage holds (released here, no rows)."""
    results = run_ranks(training_job, 4, 1, timeout=400)
    losses, _, reference = eager_run(range(2))
    mean = [sum(r["losses"][i] for r in results) / len(results) for i in range(2)]
    assert mean == pytest.approx(losses, rel=1e-5)
    assert_tensors_match(reference.state_dict(), results[0]["full"], "zero=1")
    total = sum(p.numel() * p.element_size() for p in make_gpt().parameters())
    for result in results:  # a rank of either position holds about half the model
        assert result["held"] < 0.75 * total, (result["held"], total)
