"""Ops timed on the machine at hand for the step estimate (``zeroc.runtime.cost.op_timing``).

A node's call is recorded from fake tensors, rebuilt on real ones and timed once per distinct
call; a table persists per machine; calls that cannot be rebuilt or run have no time and
keep the roofline; a plan for this CPU on its own measured profile is estimated from the
timed ops, views included, and one for another machine is not.
"""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zeroc.runtime.cost.hardware import estimate_compute_s, get_profile
from zeroc.runtime.cost.op_timing import OpTimes, encode_call, op_times_for
from zeroc.world.step_estimate import _graph_timeline_s

aten = torch.ops.aten


def test_a_call_is_recorded_from_fake_tensors_and_rebuilt_on_real_ones(tmp_path) -> None:
    with FakeTensorMode():
        a, b = torch.randn(64, 32), torch.randn(16, 32).t()
        index = torch.zeros(8, dtype=torch.long)
    call = encode_call(aten.mm.default, (torch.randn(64, 32), torch.randn(32, 16)), {})
    spec = json.loads(call)
    assert spec["op"] == "aten.mm.default"
    assert spec["args"][0] == {"$t": [64, 32], "$s": [32, 1], "$d": "float32"}
    # Strides survive (a transposed operand stays transposed), integer inputs are zeros.
    strided = json.loads(encode_call(aten.mm.default, (a, b), {}))
    assert strided["args"][1]["$s"] == [1, 32]
    # A keyword named like a marker ("device") is a keyword, not a device.
    arange = encode_call(aten.arange.default, (8,),
                         {"device": torch.device("cpu"), "dtype": torch.float32})
    times = OpTimes(str(tmp_path))
    for made in (call, arange, encode_call(aten.index_select.default, (a, 0, index), {})):
        seconds = times.seconds(made)
        assert seconds is not None and 0 < seconds < 1
    assert times.measured == 3


def test_what_cannot_be_rebuilt_or_run_has_no_time(tmp_path) -> None:
    assert encode_call(lambda x: x, (torch.ones(2),), {}) == ""  # not an OpOverload
    assert encode_call(aten.add.Tensor, (torch.ones(2), object()), {}) == ""
    issue = torch.ops._c10d_functional.all_reduce.default
    assert encode_call(issue, (torch.ones(2), "sum", "0"), {}) == ""  # communicates
    wrong = encode_call(aten.mm.default, (torch.ones(2, 3), torch.ones(2, 3)), {})
    times = OpTimes(str(tmp_path))
    assert times.seconds(wrong) is None and times.seconds("") is None


def test_the_table_persists_per_machine_and_a_corrupt_one_is_measured_again(tmp_path) -> None:
    call = encode_call(aten.add.Tensor, (torch.ones(128), torch.ones(128)), {})
    first = OpTimes(str(tmp_path))
    seconds = first.seconds(call)
    first.save()
    again = OpTimes(str(tmp_path))
    assert again.seconds(call) == seconds and again.measured == 0
    with open(again.path, "w", encoding="utf-8") as handle:
        handle.write("{not json")
    fresh = OpTimes(str(tmp_path))
    assert fresh.times == {} and fresh.seconds(call) is not None


def test_ranks_sharing_the_cores_each_get_a_share(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    call = encode_call(aten.add.Tensor, (torch.ones(64), torch.ones(64)), {})
    alone = OpTimes(str(tmp_path), ranks_per_machine=1)
    shared = OpTimes(str(tmp_path), ranks_per_machine=4)
    shared.times = alone.times
    base = alone.seconds(call)
    assert shared.seconds(call) == pytest.approx(base * 4 * torch.get_num_threads() / 2)


def test_only_a_plan_for_this_cpu_on_its_own_profile_times_ops(tmp_path) -> None:
    here = get_profile({"base": "h100-sxm", "name": "cpu-test",
                        "source": f"measured on {socket.gethostname()} today"})
    elsewhere = get_profile({"base": "h100-sxm", "name": "cpu-test",
                             "source": "measured on another-host today"})
    assert op_times_for(here, "cpu", 2, str(tmp_path)) is not None
    assert op_times_for(here, "cuda", 2, str(tmp_path)) is None
    assert op_times_for(elsewhere, "cpu", 2, str(tmp_path)) is None
    assert op_times_for(get_profile("h100-sxm"), "cpu", 2, str(tmp_path)) is None


def test_the_estimate_takes_timed_ops_and_counts_views(tmp_path) -> None:
    profile = get_profile("h100-sxm")
    big = encode_call(aten.mm.default, (torch.ones(256, 256), torch.ones(256, 256)), {})
    view = encode_call(aten.view.default, (torch.ones(256, 256), [-1]), {})
    nodes = (SimpleNamespace(name="mm", flops=2 * 256 ** 3, bytes=3 * 256 * 256 * 4, call=big),
             SimpleNamespace(name="view", flops=0, bytes=0, call=view),
             SimpleNamespace(name="fused", flops=10, bytes=40, call=""))
    graph = SimpleNamespace(node_costs=nodes, flops=0, bytes=0)
    times = OpTimes(str(tmp_path))
    compute, _ = _graph_timeline_s(graph, [], "float32", profile, 1, False, times)
    expected = (times.seconds(big) + times.seconds(view)
                + estimate_compute_s(10, 40, "float32", profile))
    assert compute == pytest.approx(expected)
    roofline, _ = _graph_timeline_s(graph, [], "float32", profile, 1, False)
    assert roofline == pytest.approx(sum(estimate_compute_s(n.flops, n.bytes, "float32",
                                                            profile) for n in nodes if n.flops))


def test_the_optimizer_is_timed_on_dtensors_when_parameters_are_sharded(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.tensor import DTensor

    stepped = []  # per timed step: whether its parameters were DTensors (not how long it took)
    step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        stepped.append({isinstance(p, DTensor) for g in self.param_groups for p in g["params"]})
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    times = OpTimes(str(tmp_path))
    plain = times.optimizer_seconds([4096] * 20, dtensor=False)
    timed_plain, stepped[:] = list(stepped), []
    sharded = times.optimizer_seconds([4096] * 20, dtensor=True)
    assert plain is not None and sharded is not None and plain > 0 and sharded > 0
    assert timed_plain and all(kinds == {False} for kinds in timed_plain)
    assert stepped and all(kinds == {True} for kinds in stepped)
    assert times.optimizer_seconds([], dtensor=True) == 0.0
    assert not torch.distributed.is_initialized()  # the fake group it made is gone


class _Keyed:
    """A callable named for timing by its ``timing_key``, as zeroc's fused kernels are."""

    timing_key = "zeroc.kernel_test.aten"

    def __init__(self) -> None:
        self.pointers: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(1 << 16)  # 256 KiB: a fresh block unless an earlier one is freed
        self.pointers.append(out.data_ptr())
        return out.copy_(x.repeat(1 << 6))


def test_a_fused_kernel_is_timed_by_its_key_while_it_lives(tmp_path) -> None:
    kernel = _Keyed()
    call = encode_call(kernel, (torch.ones(1 << 10),), {})
    assert json.loads(call)["op"] == _Keyed.timing_key
    times = OpTimes(str(tmp_path))
    assert times.seconds(call) is not None
    # Every timed call (after the warm-up, whose output is let go) wrote memory of its own:
    # the outputs were held, as a training graph holds what its ops write, instead of
    # reusing the block the previous call freed.
    timed = kernel.pointers[1:]
    assert len(timed) >= 3 and len(set(timed)) == len(timed)
    del kernel  # gone: its key cannot be rebuilt, and the estimate keeps the roofline
    assert OpTimes(str(tmp_path / "other")).seconds(call) is None


class _NormedLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)).pow(2).mean()


def test_a_planned_graph_times_its_fused_kernels(tmp_path) -> None:
    import zeroc

    model = _NormedLoss()
    profile = get_profile({"base": "h100-sxm", "name": "cpu-test",
                           "source": f"measured on {socket.gethostname()} today"})
    plan = zeroc.explain(model, (torch.randn(8, 32),), world=1, device="cpu",
                         hardware=profile, options={"cache_dir": str(tmp_path)})
    kernels = [c for g in plan.graphs for c in g.node_costs if c.target.startswith("zeroc_")]
    assert kernels and all(json.loads(c.call)["op"].startswith("zeroc.kernel_")
                           for c in kernels)
    times = op_times_for(profile, "cpu", 1, str(tmp_path))
    assert all(times.seconds(c.call) is not None for c in kernels)
