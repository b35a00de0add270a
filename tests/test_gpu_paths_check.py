"""The GPU check's sections on zeroc's distributed paths (``benchmarks/gpu_checks/paths.py``).

``collectives`` keeps zeroc's collectives on a world-1 group (``kept_collectives``) and
``pipeline`` runs a pp=2 pipeline's positions on one device (``gpu_checks.pipeline_run``).
Here: the switch is scoped to its block, the checks on what a kept model compiled and on
where a pipeline step waited, and ``check_path_sections``, what the ``--cpu-smoke`` run of
``tests/test_gpu_check.py`` must show of both sections.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
from gpu_checks import paths  # noqa: E402 -- needs the path above


def check_path_sections(sections: dict[str, Any]) -> None:
    """The ``collectives`` and ``pipeline`` records of a ``--cpu-smoke`` run: every kept model
    matched eager's losses on the world-1 group and issued its gathers and reductions, the
    quantized one in int8, and both pipeline positions
    ran every step of their stages with steps 3-5 counted and their timings measured."""
    collectives = sections["collectives"]
    assert collectives["status"] == "ok", collectives
    figures = collectives["figures"]
    models = figures["models"]
    assert set(models) == {"zero3", "quantized", "offload"}
    for name, model in models.items():
        assert model["loss_comparison"]["agree"], name
        assert model["process_group"]["world_size"] == 1, name
    for name in ("zero3", "offload"):  # a group of one moves exactly the data
        assert models[name]["loss_comparison"]["max_abs_diff"] < 1e-4, name
    assert models["quantized"]["collectives"]["all_gather int8"] > 0
    assert models["offload"]["offload"] == "optimizer"
    pipeline = sections["pipeline"]
    assert pipeline["status"] == "ok", pipeline
    figures = pipeline["figures"]
    assert [p["stages"] for p in figures["positions"]] == [[0, 3], [1, 2]]
    for position in figures["positions"]:
        assert position["error"] is None and len(position["step_s"]) == figures["steps"]
        assert set(position["syncs"]) == {"3", "4", "5"} and position["measured_groups"] > 0


def test_kept_collectives_and_their_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check's switch names a one-rank dp group and lowers its marks only inside its
    block; a kept model's collectives must hold gathers and reductions (int8 ones when
    quantized); a pipeline position passes with at most read_rows' one wait per step."""
    import zeroc.passes.zero_buckets as zero_pass
    from zeroc.runtime import mesh as mesh_module

    before = (mesh_module._from_device_mesh, zero_pass.COLLECTIVE_MIN_RANKS)
    built = []
    fake_mesh = type("M", (), {"get_group": lambda self: type("G", (), {"group_name": "7"})()})
    monkeypatch.setattr(mesh_module, "_from_device_mesh", lambda *a: mesh_module.Mesh(
        1, 1, 1, 0, 0, 0, "", (0,), "", (0,), fake_mesh()))
    with paths.kept_collectives("cpu"):
        assert zero_pass.COLLECTIVE_MIN_RANKS == 1
        built.append(mesh_module._from_device_mesh(None, 1, 1, 0, "cpu"))
    assert built[0].dp_group_name == "7"
    assert zero_pass.COLLECTIVE_MIN_RANKS == before[1] == 2
    assert mesh_module._from_device_mesh(None, 1, 1, 0).dp_group_name == ""
    exact = {"all_gather float32": 9, "reduce_scatter float32": 5}
    assert paths.check_counts(exact, quantized=False) is None
    assert "not int8" in paths.check_counts(exact, quantized=True)
    assert "no gathers" in paths.check_counts({"reduce_scatter float32": 5}, False)
    assert paths.check_counts({"all_gather int8": 7, "all_gather float32": 2,
                               "reduce_scatter int8": 4}, quantized=True) is None
    wait = {"what": "torch.cuda.Event.synchronize",
            "site": "runtime/pipeline/sync.py:101 (read_rows)"}
    position = {"position": 0, "error": None, "step_s": [0.1] * 6,
                "syncs": {"3": [], "4": [wait], "5": [wait]}}
    assert paths.pipeline_figures({"steps": 6, "positions": [position]})["ok"]
    position["syncs"]["5"] = [wait, {"what": "aten._local_scalar_dense", "site": "x.py:1 (f)"}]
    figures = paths.pipeline_figures({"steps": 6, "positions": [position]})
    assert not figures["ok"] and "step 5 waited" in figures["reason"]
    assert not paths.pipeline_figures({"steps": 6, "positions": []})["ok"]
