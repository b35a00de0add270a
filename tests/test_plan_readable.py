"""A plan that explains itself: golden plan texts, and each piece of the text on small plans.

The golden files under ``tests/golden/`` are ``str(plan)`` of the demo (``python -m zeroc demo``
at a small size, single process, ``--zero 0``) and ``str(plan.full())`` of the tiny zoo GPT
planned for two ranks at ZeRO-3 on fake tensors, after ``mask`` (versions and the graph hash).
A change to the plan's text fails with a unified diff; regenerate the files with
``ZEROC_UPDATE_GOLDEN=1 pytest tests/test_plan_readable.py`` and review the diff in git.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import json
import os
import re

import pytest
import torch
from models.gpt import GPT, GPTConfig

import zeroc
from zeroc import explain as explain_plan  # the function, before its submodule is imported
from zeroc.cli.explain_cli import _parser
from zeroc.frontend.session_plan import (
    _memory_rows,
    _unique_kernels,
    _with_full_shapes,
    _with_mesh_dims,
)
from zeroc.runtime.layout import ParamShard, ZeroLayout
from zeroc.runtime.mesh import Mesh
from zeroc.runtime.plan.plan import Plan, PlanMeta
from zeroc.runtime.plan.plan_format import MAX_ROWS, WIDTH, stat_text
from zeroc.runtime.plan.records import (
    CollectiveInfo,
    GraphInfo,
    KernelInfo,
    ParamInfo,
    PassInfo,
)

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
UPDATE = os.environ.get("ZEROC_UPDATE_GOLDEN") == "1"
DEMO_ARGS = ["--device", "cpu", "--steps", "1", "--zero", "0", "--layers", "2", "--width", "32",
             "--seq", "16", "--batch", "2"]


def mask(text: str) -> str:
    """``text`` without what changes between machines and versions: the versions and hash."""
    return re.sub(r"^zeroc plan [0-9a-f]+  \(zeroc .*\)$",
                  "zeroc plan <hash>  (zeroc <v>, torch <v>, triton <v>)", text, flags=re.M)


def check_golden(name: str, text: str) -> None:
    """Compare ``mask(text)`` with ``tests/golden/<name>`` (``ZEROC_UPDATE_GOLDEN=1``: write)."""
    path = os.path.join(GOLDEN, name)
    got = mask(text).rstrip("\n") + "\n"
    if UPDATE:
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as handle:
            handle.write(got)
    with open(path) as handle:
        want = handle.read()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True),
                                            f"golden/{name}", "this run"))
        pytest.fail(f"the plan text differs from tests/golden/{name} (regenerate with "
                    f"ZEROC_UPDATE_GOLDEN=1):\n{diff}", pytrace=False)


@pytest.fixture(scope="module")
def demo() -> tuple[str, Plan]:
    """The demo's printed plan and the Plan it printed."""
    from zeroc.cli.demo import run_demo

    plans = []
    zeroc.explain = lambda compiled: plans.append(explain_plan(compiled)) or plans[-1]
    out = io.StringIO()
    try:
        torch._dynamo.reset()
        with contextlib.redirect_stdout(out):
            assert run_demo(DEMO_ARGS) == 0
    finally:
        zeroc.explain = explain_plan
    text = out.getvalue()
    return text[text.index("zeroc plan "):], plans[0]


@pytest.fixture(scope="module")
def world_plan() -> Plan:
    torch._dynamo.reset()
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return explain_plan(GPT(GPTConfig.tiny()), (tokens, tokens), world=2, pp=1, zero=3,
                        device="cpu")


def test_demo_plan_matches_golden(demo: tuple[str, Plan]) -> None:
    text, plan = demo
    assert text.rstrip("\n") == str(plan)
    check_golden("plan_demo.txt", text)


def test_fake_world_plan_matches_golden(world_plan: Plan) -> None:
    check_golden("plan_gpt_world2_zero3.txt", str(world_plan.full()))


def test_demo_plan_explains_itself(demo: tuple[str, Plan]) -> None:
    text, plan = demo
    names = [k.name for k in plan.kernels]
    assert len(set(names)) == len(names)
    assert all(n.startswith(("g0.forward.zeroc_", "g0.backward.zeroc_")) for n in names)
    assert plan.kernel(names[-1]).source and names[-1] in text
    with pytest.raises(KeyError, match="no kernel 'zeroc_red_0'"):
        plan.kernel("zeroc_red_0")
    # Original shapes, not the flat buffers the graphs read; byte stats in KiB.
    assert {p.name: p.full_shape for p in plan.params}["tok_emb.weight"] == (256, 32)
    assert re.search(r"\ntok_emb\.weight +256x32 +float32 +8\.19k +32\.0 KiB", text)
    # The demo runs on the aten path, where recomputed ops would not fuse (see the option).
    assert "activation_recompute='auto' on the aten path" in text
    assert "options: all defaults" in text and "zero 0" in text
    assert f"... {len(plan.params) - MAX_ROWS} more rows (every row: str(plan.full())" in text
    lines = text.splitlines()
    legends = [line for line in lines if line.startswith("  ") and "   " not in line.strip()]
    assert len(legends) > 10 and all(len(line) <= WIDTH for line in lines[:3] + legends)


def test_full_shows_every_row_and_round_trips(demo: tuple[str, Plan]) -> None:
    _, plan = demo
    full = plan.full()
    assert full == plan and full.to_json() == plan.to_json()
    text = str(full)
    assert "more rows" not in text and all(p.name in text for p in plan.params)
    assert "options: mode=default, kernels=auto" in text
    again = Plan.from_json(plan.to_json())
    assert again == plan and str(again) == str(plan) and not again.show_all
    # A plan written before the new fields existed still loads, with their defaults.
    old = json.loads(plan.to_json())
    del old["meta"]["option_defaults"]
    for param in old["params"]:
        del param["full_shape"]
    older = Plan.from_json(json.dumps(old))
    assert older.meta.option_defaults == () and "options: mode=default" in str(older)


def test_world_plan_names_mesh_dims_shards_and_ranks(world_plan: Plan) -> None:
    text = str(world_plan)
    assert {c.mesh_dim for c in world_plan.collectives} == {"dp"}
    assert "over = the mesh dimension whose group runs it (dp: 2 ranks)" in text
    assert re.search(r"\ntok_emb\.weight +64x32 +float32 +2\.05k +1\.02k +4\.0 KiB", text)
    assert re.search(r"\n0-1 +\d", text) and "rows are grouped when identical" in text


def _plan(**changes: object) -> Plan:
    meta = PlanMeta(format=1, zeroc_version="0", torch_version="0", triton_version="-",
                    device="cpu", world_size=4, mesh=(("pp", 1), ("dp", 4)), zero=3,
                    schedule="none", options=(("bucket_mb", "25.0"), ("prefetch", "2")),
                    graph_hash="abc", option_defaults=(("bucket_mb", "25.0"), ("prefetch", "1")))
    graph = GraphInfo(name="g0.forward", kind="forward", nodes=3, inputs=1, outputs=1, flops=10,
                      bytes=4096, peak_bytes=2048, node_costs=(), code="")
    empty = dataclasses.replace(graph, name="g0.s0.input_grad", kind="input_grad", nodes=0)
    fields = dict(meta=meta, graphs=(graph, empty), stages=(), params=(), kernels=(),
                  collectives=(), memory=(), passes=())
    return Plan(**{**fields, **changes})


def test_options_empty_graphs_groups_and_byte_stats() -> None:
    collective = CollectiveInfo(name="g0.forward.gather0", graph="g0.forward", op="all_gather",
                                group="7", params=("w",), bytes=3 << 20, issued_at="a",
                                waited_at="b", mesh_dim="")
    passes = (PassInfo(pass_name="p", graph="g0.joint", changed=True, nodes_before=2,
                       nodes_after=1, before="", after="",
                       stats=(("bytes_not_saved", "6291456"), ("tagged", "3"))),)
    text = str(_plan(collectives=(collective,), passes=passes))
    assert "options: prefetch=2 (the rest are defaults; all: str(plan.full()))" in text
    assert "bucket_mb" not in text.split("graphs:")[0]
    assert "g0.s0.input_grad" not in text.split("graphs:")[1].split("  per call")[0]
    assert "not shown, empty (no ops): g0.s0.input_grad" in text
    assert re.search(r"group 7 +1 +3\.0 MiB", text)  # no mesh dimension known: the group id
    assert "bytes_not_saved=6.0 MiB, tagged=3" in text
    assert stat_text("bytes", "1536") == "bytes=1.5 KiB"
    assert stat_text("kernels", "5") == "kernels=5"


def test_unique_kernel_names_keep_sources_and_repeat_suffix() -> None:
    kernel = KernelInfo(name="zeroc_red_2", graph="g0.forward", backend="aten", kind="reduction",
                        ops=(), numel=4, source="def zeroc_red_2(): ...", source_hash="h",
                        block=())
    backward = dataclasses.replace(kernel, graph="g0.backward")
    named = _unique_kernels([kernel, backward, kernel])
    assert [k.name for k in named] == ["g0.forward.zeroc_red_2", "g0.backward.zeroc_red_2",
                                       "g0.forward.zeroc_red_2#2"]
    assert _unique_kernels(list(named)) == named  # named once


def _layout(rank: int) -> ZeroLayout:
    mesh = Mesh(world=2, pp=1, dp=2, rank=rank, pp_index=0, dp_index=rank, dp_group_name="7",
                dp_group_ranks=(0, 1), pp_group_name="", pp_group_ranks=(rank,))
    shard = ParamShard(name="w", param_name="w", tied_names=(), shape=(3, 4), dtype="float32",
                       numel=12, padded_numel=16, shard_numel=8, requires_grad=True,
                       local_rows=2 - rank)
    return ZeroLayout(zero=3, pp=1, dp=2, world=2, mixed_precision=None, mesh=mesh,
                      params=(shard,))


def test_build_plan_helpers_use_the_layout() -> None:
    rows = _memory_rows(_layout(1), 0, activations=100, moved=64)
    # Rank 0 owns 2 of the 3 rows, rank 1 one: gradients and Adam state differ, buffers don't.
    assert [(m.rank, m.params, m.grads, m.optimizer) for m in rows] == [
        (0, 32, 32, 64), (1, 32, 16, 32)]
    assert all(m.peak == m.params + m.grads + m.optimizer + 100 and m.moved == 64 for m in rows)
    assert rows == _memory_rows(_layout(0), 0, activations=100, moved=64)
    param = ParamInfo(name="w", shape=(8,), dtype="float32", numel=8, bytes=32)
    assert _with_full_shapes((param,), _layout(0))[0].full_shape == (3, 4)
    gather = CollectiveInfo(name="c", graph="g0.forward", op="all_gather", group="7",
                            params=("w",), bytes=1, issued_at="a", waited_at="b")
    other = dataclasses.replace(gather, group="9")
    assert [c.mesh_dim for c in _with_mesh_dims((gather, other), _layout(0))] == ["dp", ""]
    text = str(_plan(memory=rows, params=_with_full_shapes((param,), _layout(0))))
    assert re.search(r"\nw +3x4 +float32 +12 +8 +32 B", text)
    assert "1/4 of dimension 0's rows" in text and "rows are grouped" not in text


def test_cli_full_flag() -> None:
    assert _parser().parse_args(["m.py:build", "--world", "2", "--full"]).full
    assert not _parser().parse_args(["m.py:build", "--world", "2"]).full
    assert "--full" in _parser().format_help()


def test_zero1_plan_says_what_it_holds_and_moves() -> None:
    """DeepSpeed's ZeRO-1 in a plan for 4 CUDA ranks: the header says what the stage holds,
    the backward reduce-scatters (no all-reduce, no gather in the graphs), the one all-gather
    runs after ``optimizer.step()``, and the two move what ZeRO-2 moves."""
    torch._dynamo.reset()
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    plans = {zero: explain_plan(GPT(GPTConfig.tiny(), seed=0), (tokens, tokens), world=4,
                                zero=zero, device="cuda") for zero in (1, 2)}
    text = str(plans[1].full())
    assert re.search(r"^zero 1: whole parameters; gradients and optimizer state this rank's "
                     r"rows; gradients\s+reduce-scattered, parameters all-gathered after "
                     r"optimizer\.step\(\)", text, re.M), text[:600]
    ops = {(c.graph.rsplit(".", 1)[-1], c.op) for c in plans[1].collectives}
    assert ops == {("backward", "reduce_scatter"), ("step", "all_gather")}, ops
    moved = {z: sum(c.bytes for c in p.collectives) for z, p in plans.items()}
    assert moved[1] == moved[2], moved
    held = plans[1].memory[0]
    assert held.grads * 4 == held.params and held.optimizer == 2 * held.grads, held
