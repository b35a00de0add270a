"""Ranks that share a CPU host: the calibrated slowdown of computing together, its use by
the step estimate for this machine, and collectives run in line when no core is spare."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from zeroc.runtime.cost.hardware import HardwareProfile, estimate_collective_s, get_profile
from zeroc.runtime.cost.op_timing import OpTimes
from zeroc.runtime.cost.shared_cores import no_spare_cores, slowdown_for
from zeroc.runtime.errors import OptionError
from zeroc.world.step_estimate import _graph_timeline_s

PROFILE = get_profile({"base": "h100-sxm", "intra_node_bytes_per_s": 1e9,
                       "intra_node_latency_s": 1e-9})


def test_profile_keeps_and_checks_the_slowdown() -> None:
    profile = get_profile({"base": "h100-sxm", "shared_slowdown": {"2": 1.3}})
    assert profile.shared_slowdown == {"2": 1.3}
    assert HardwareProfile.from_dict(profile.to_dict()) == profile
    assert "shared_slowdown" not in get_profile("h100-sxm").to_dict()  # optional, absent
    for bad in ({"two": 1.3}, {"2": 0.5}, {"2": True}, [1.3]):
        with pytest.raises(OptionError, match="'shared_slowdown'"):
            get_profile({"base": "h100-sxm", "shared_slowdown": bad})


def test_the_measured_factor_is_used_for_its_rank_count_only() -> None:
    profile = SimpleNamespace(shared_slowdown={"2": 1.25})
    assert slowdown_for(profile, 2, 1) == 1.25
    cores = os.cpu_count() or 1
    # Another rank count: the share of the cores when the threads outnumber them, else 1.
    assert slowdown_for(profile, 3, cores) == pytest.approx(3.0)
    assert slowdown_for(profile, 1, 1) == 1.0
    assert slowdown_for(None, 1, 1) == 1.0
    times = OpTimes(None, ranks_per_machine=2, profile=profile)
    assert times.scale == 1.25
    assert times.inline_communication == no_spare_cores(2, torch.get_num_threads())


def test_no_spare_cores() -> None:
    cores = os.cpu_count() or 1
    assert no_spare_cores(cores, 1)
    assert not no_spare_cores(1, cores)  # one rank: nothing else competes for its cores
    if cores > 2:
        assert not no_spare_cores(2, 1)


def _graph(*names: str) -> SimpleNamespace:
    return SimpleNamespace(node_costs=tuple(
        SimpleNamespace(name=n, flops=2 * 4096 ** 3 if n.startswith("mm") else 0, bytes=0,
                        call="") for n in names), flops=0, bytes=0)


def _gather(issued_at: str, waited_at: str, nbytes: int) -> SimpleNamespace:
    return SimpleNamespace(name=f"gather@{issued_at}", op="all_gather", bytes=nbytes,
                           issued_at=issued_at, waited_at=waited_at, graph="g0.forward")


def test_collectives_run_in_line_when_the_cores_are_full() -> None:
    graph = _graph("ag", "mm1", "mm2", "wait", "mm3")
    gather = [_gather("ag", "wait", 10 ** 6)]
    comm = estimate_collective_s("all_gather", 10 ** 6, 2, PROFILE, False)
    spare = SimpleNamespace(inline_communication=False, seconds=lambda call: None)
    full = SimpleNamespace(inline_communication=True, seconds=lambda call: None)
    compute, hidden = _graph_timeline_s(graph, gather, "float32", PROFILE, 2, False, spare)
    assert hidden == pytest.approx(max(compute, comm + 2 * compute / 3))  # hides
    compute_inline, inline = _graph_timeline_s(graph, gather, "float32", PROFILE, 2, False, full)
    assert compute_inline == pytest.approx(compute)
    assert inline == pytest.approx(compute + comm)  # nothing hides
    loose = [_gather("elsewhere", "nowhere", 10 ** 6)]
    _, outside = _graph_timeline_s(graph, loose, "float32", PROFILE, 2, False, full)
    assert outside == pytest.approx(compute + comm)
