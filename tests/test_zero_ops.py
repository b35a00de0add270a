"""The zeroc::unshard / zeroc::reduce_grad custom ops (arithmetic, collectives, tracing), and the
multi-rank harness the distributed tests rely on."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from dist_harness import RankError, RankTimeout, run_ranks
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.fx.experimental.proxy_tensor import make_fx

from zeroc.runtime.zero_ops import (
    local_rows_for,
    padded_numel_for,
    reduce_grad,
    shard_numel_for,
    shard_of,
    unshard,
)

UNSHARD = torch.ops.zeroc.unshard.default
REDUCE_GRAD = torch.ops.zeroc.reduce_grad.default


def test_shard_arithmetic() -> None:
    """Rows of dimension 0 split as DTensor's Shard(0): ceil(d0 / dp) rows per rank."""
    assert [padded_numel_for((n,), 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    assert shard_numel_for((5,), 2) == 3
    assert padded_numel_for((5, 3), 4) == 24 and shard_numel_for((5, 3), 4) == 6
    assert [local_rows_for((5, 3), 4, i) for i in range(4)] == [2, 2, 1, 0]
    assert [local_rows_for((5, 3), 4, i) for i in range(4)] == [
        len(c) for c in torch.arange(15.0).view(5, 3).chunk(4)] + [0]
    full = torch.arange(10.0).view(5, 2)
    shards = [shard_of(full, 4, i) for i in range(4)]
    assert all(s.shape == (4,) for s in shards)
    assert torch.equal(torch.cat(shards), torch.cat([torch.arange(10.0), torch.zeros(6)]))


def test_ops_without_a_group_only_reshape() -> None:
    shard = torch.arange(6.0, requires_grad=True)
    weight = unshard(shard, (2, 3), 6, "", 3)
    assert torch.equal(weight, torch.arange(6.0).view(2, 3))
    assert weight.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr()
    (weight * torch.arange(6.0).view(2, 3)).sum().backward()
    assert torch.equal(shard.grad, torch.arange(6.0))
    grad = torch.ones(2, 3)
    reduced = reduce_grad(grad, 6, "", 2)
    assert reduced.shape == (6,) and reduced.data_ptr() != grad.data_ptr()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: unshard(torch.zeros(4), (4,), 4, "", 4), "zero_stage=4"),
        (lambda: unshard(torch.zeros(4), (4,), 4, "", 5), r"zero_stage=5 .*\(0, 1, 2 or 3\)"),
        (lambda: unshard(torch.zeros(2, 2), (4,), 4, "", 3), "must be 1-D"),
        (lambda: unshard(torch.zeros(3), (4,), 4, "", 3), "cannot hold numel=4"),
        (lambda: reduce_grad(torch.zeros(5), 4, "", 3), "padded_numel=4"),
    ],
)
def test_op_errors(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_fake_tensor_shapes() -> None:
    graph = make_fx(lambda s: unshard(s, (3, 2), 5, "", 3) * 2, tracing_mode="fake")(
        torch.zeros(6)
    )
    assert [n.target for n in graph.graph.nodes if n.op == "call_function"][0] is UNSHARD


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(6.0).view(2, 3) / 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight).tanh().sum()


def _compiled_graphs(model: torch.nn.Module, x: torch.Tensor):
    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(kind: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm)

        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    loss = torch.compile(model, backend=backend)(x)
    loss.backward()
    return loss, graphs


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_dynamo_and_aot_autograd_trace_the_ops() -> None:
    from zeroc.sharding.parallelize import parallelize

    x = torch.ones(4, 2)
    eager = _Scaled()
    eager(x).backward()
    model = parallelize(_Scaled(), zero=3)
    loss, graphs = _compiled_graphs(model, x)
    print(graphs["forward"].code)
    print(graphs["backward"].code)
    assert UNSHARD in _targets(graphs["forward"])
    assert REDUCE_GRAD not in _targets(graphs["forward"])
    assert REDUCE_GRAD in _targets(graphs["backward"])
    torch.testing.assert_close(loss, eager(x))
    # The flat buffer's gradient was moved to the visible parameter (plain: no process group).
    assert model.__dict__["_zeroc_flat_weight"].grad is None
    torch.testing.assert_close(model.weight.grad, eager.weight.grad)


def ops_on_ranks(rank: int, world: int) -> dict:
    """Each stage's ops on known inputs, plus a compiled ZeRO-3 step, on this rank."""
    from zeroc.runtime.mesh import build_mesh
    from zeroc.sharding.parallelize import parallelize

    group = build_mesh(1).dp_group_name
    out: dict = {"group": group}
    full = torch.arange(9.0).view(3, 3)
    for stage in (0, 1, 2, 3):
        shard = full.flatten().clone() if stage <= 1 else shard_of(full, world, rank)
        shard.requires_grad_(True)
        gathered = unshard(shard, (3, 3), 9, group, stage)
        # Rank r's gradient is (r + 1) * ones: the average over ranks is (world + 1) / 2.
        gathered.backward(torch.full((3, 3), float(rank + 1)))
        out[stage] = {"gathered": gathered.detach(), "grad": shard.grad}
    out["bf16"] = unshard(shard_of(full, world, rank).bfloat16(), (3, 3), 9, group, 3)
    x = torch.full((4, 2), float(rank + 1))
    model = parallelize(_Scaled(), zero=3)
    loss, graphs = _compiled_graphs(model, x)
    out["compiled"] = {
        "loss": loss.detach(),
        "grad": model.weight.grad.to_local(),
        "forward": _targets(graphs["forward"]).count(UNSHARD),
        "backward": _targets(graphs["backward"]).count(REDUCE_GRAD),
    }
    return out


@pytest.mark.timeout(180)
def test_ops_communicate_on_two_ranks() -> None:
    world = 2
    results = run_ranks(ops_on_ranks, world, timeout=150)
    full = torch.arange(9.0).view(3, 3)
    mean_grad = torch.full((9,), (world + 1) / 2)
    assert results[0]["group"] != ""
    for rank, result in enumerate(results):
        for stage in (0, 1, 2, 3):
            assert torch.equal(result[stage]["gathered"], full)
            # Stage 0 keeps the whole gradient; sharded stages a zero-padded slice of it;
            # stage 1 (whole parameters) this rank's rows of it in place, zeros elsewhere.
            expected = mean_grad if stage == 0 else shard_of(mean_grad.view(3, 3), world, rank)
            if stage == 1:
                expected = torch.zeros(9)
                rows = slice(rank * 6, min(9, rank * 6 + 6))  # 2 rows of 3 per rank
                expected[rows] = mean_grad[rows]
            torch.testing.assert_close(result[stage]["grad"], expected)
        assert result["bf16"].dtype == torch.bfloat16
        assert torch.equal(result["bf16"], full.bfloat16())
        assert result["compiled"]["forward"] == 1 and result["compiled"]["backward"] == 1
    eager = _Scaled()
    for rank in range(world):
        eager(torch.full((4, 2), float(rank + 1))).backward()
    expected_grad = (eager.weight.grad / world)[:1]  # rank 0's row of the (2, 3) weight
    torch.testing.assert_close(results[0]["compiled"]["grad"], expected_grad)


def _fail_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    torch.distributed.barrier()
    return rank


def _return_rank(rank: int, world: int) -> int:
    return rank


def _sleep_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(60)
    return rank


@pytest.mark.timeout(60)
def test_harness_reports_a_rank_error_with_its_traceback() -> None:
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 raised:\nTraceback.*rank one refuses"):
        run_ranks(_fail_on_rank_one, 2, timeout=30)


@pytest.mark.timeout(60)
def test_harness_kills_ranks_past_the_timeout() -> None:
    assert run_ranks(_return_rank, 2) == [0, 1]  # warm start: the timeout counts start-up too
    started = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[1\] of 2 did not finish within 6 s"):
        run_ranks(_sleep_on_rank_one, 2, timeout=6)
    assert time.monotonic() - started < 40


def _crash_rank_one(rank: int, world: int, after_s: float) -> int:
    if rank == 1:
        time.sleep(after_s)
        os.kill(os.getpid(), signal.SIGKILL)
    if after_s:
        raise RuntimeError("rank zero lost its peer")
    time.sleep(30)
    return rank


@pytest.mark.timeout(60)
def test_harness_names_a_crashed_rank() -> None:
    with pytest.raises(RankError, match=r"^rank 1 of 2 was killed by SIGKILL without "
                                        r"reporting a result$"):
        run_ranks(_crash_rank_one, 2, 0.0, timeout=30)


@pytest.mark.timeout(60)
def test_harness_names_a_crashed_rank_before_the_errors_it_caused() -> None:
    # Rank 0's error comes first; rank 1 dies within the grace period that follows it.
    with pytest.raises(RankError, match=r"(?s)^rank 1 of 2 was killed by SIGKILL without "
                                        r"reporting a result\nrank 0 of 2 raised:.*lost its peer"):
        run_ranks(_crash_rank_one, 2, 0.5, timeout=30)
