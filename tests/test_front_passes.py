"""The pipeline front's transforms as passes: rows in the plan's pass table, the same results.

``zeroc.pipeline.pipeline_front`` runs ``specialize``, ``keep_loss_output``,
``normalize_loss``, ``hoist_unshards``, ``microbatch_graph`` and ``split_stages`` through
``run_passes`` (``zeroc.passes.pipeline``'s lists): each gets a row with its graph before and
after, ``split_stages`` returns the micro-batch graph as its stages call one another, and
what the passes publish in the ``FrontContext`` is what the compiler used before. Also:
``run_passes`` on an IR that is not a graph (a ``PassSubject``), and the stage balance that
the compiler and the tuner's screen share.
"""

from __future__ import annotations

import random

import pytest
import torch
from models.gpt import GPT, GPTConfig
from torch.testing import FileCheck

import zeroc
from zeroc.frontend.config import Config
from zeroc.passes.base import PassContext, PassResult, run_passes
from zeroc.passes.front.context import FrontContext, PassOrderError
from zeroc.passes.front.split_stages import split_stages
from zeroc.passes.front.stage_balance import partition_costs
from zeroc.passes.pipeline import HOIST_PASSES, LOSS_PASSES, NORMALIZE_PASSES, STAGE_PASSES
from zeroc.tuning import tune_screen
from zeroc.world import plan_workers

BATCH, MICRO = 4, 2
FRONT_ROWS = ("specialize_outputs", "keep_loss_output")
MICROBATCH_ROWS = ("specialize", "keep_loss_output", "normalize_loss", "hoist_unshards",
                   "microbatch_graph", "split_stages")


def _planned(record_graphs: bool) -> zeroc.Plan:
    torch._dynamo.reset()
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32), seed=1)
    tokens = torch.randint(0, 64, (BATCH, 16), generator=torch.Generator().manual_seed(1))
    return zeroc.explain(model, (tokens, tokens), world=2, pp=2, zero=3, device="cpu",
                         options={"schedule": "1f1b", "microbatches": 2,
                                  "record_graphs": record_graphs})


@pytest.fixture(scope="module")
def planned() -> tuple[zeroc.Plan, zeroc.Plan]:
    """A pp=2 plan with every pass's graphs recorded, and the same plan without them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_workers, "planning_cores", lambda: 1)
        return _planned(True), _planned(False)


def test_every_front_pass_has_a_row_with_its_graphs(planned) -> None:
    plan, _ = planned
    table = str(plan.full()).split("\npasses:\n")[1]
    check = FileCheck()
    for name in FRONT_ROWS:
        check = check.check("g0.front  ").check_same(f" {name} ")
    for name in MICROBATCH_ROWS[:2]:
        check = check.check("g0.microbatch ").check_same(f" {name} ")
    check = check.check("g0.dynamo ").check_same("fuse_linear_cross_entropy")
    for name in MICROBATCH_ROWS[2:]:
        check = check.check("g0.microbatch ").check_same(f" {name} ")
    check.check("g0.s0.joint").run(table)
    assert [r.pass_name for r in plan.passes_for("g0.front")] == list(FRONT_ROWS)
    rows = plan.passes_for("g0.microbatch")
    assert [r.pass_name for r in rows] == list(MICROBATCH_ROWS)
    for row in (*plan.passes_for("g0.front"), *rows):
        assert row.before.strip() and row.after.strip(), row.pass_name
    hoist = rows[MICROBATCH_ROWS.index("hoist_unshards")]
    assert hoist.changed and hoist.nodes_after < hoist.nodes_before
    assert "unshard" in hoist.before and "unshard" not in hoist.after
    normalize = rows[MICROBATCH_ROWS.index("normalize_loss")]
    assert dict(normalize.stats)["kind"] == "token_mean"
    split = rows[-1]
    assert dict(split.stats)["stages"] == "2" and split.nodes_after < split.nodes_before
    # The cut: the micro-batch graph as two stage calls, the second reading the first.
    (FileCheck().check("class StageCalls").check("stage0 = self.stage0(")
     .check("= stage0[0]").check("stage1 = self.stage1(").check("return")
     .check("class stage0").check("class stage1").run(split.after))


def test_records_change_nothing_but_the_pass_texts(planned) -> None:
    recorded, plain = planned

    def body(plan: zeroc.Plan) -> list[str]:  # the plan but its digest, options and passes
        return [line for line in str(plan).split("\npasses:\n")[0].splitlines()[1:]
                if not line.startswith("options:")]

    assert body(recorded) == body(plain)
    assert [(p.graph, p.pass_name, p.nodes_before, p.nodes_after, p.stats)
            for p in recorded.passes] == [(p.graph, p.pass_name, p.nodes_before, p.nodes_after,
                                           p.stats) for p in plain.passes]
    assert all(not p.before and not p.after for p in plain.passes)


def _captured(model: torch.nn.Module):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    x, y = model.example_batch(BATCH)
    torch.compile(model, backend=keep, dynamic=False)(x, y)
    (gm, inputs), = graphs
    return gm, list(inputs), (x, y)


def test_static_front_passes_compose_to_the_eager_micro_batch_loss() -> None:
    """A static graph (no dynamic batch) through the front's lists: the loss kept, made a
    sum, the batch constants shrunk, the graph cut; the graph ``split_stages`` returns runs
    the stages and gives the eager loss of one micro-batch, times its token count."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32), seed=3)
    gm, inputs, (x, y) = _captured(model)
    params = {i for i, v in enumerate(inputs) if isinstance(v, torch.nn.Parameter)}
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    batch = {names.index("l_idx_"), names.index("l_targets_")}
    ctx = FrontContext(config=Config.build(options={"record_graphs": True}), graph_name="t.front",
                       kind="front", inputs=inputs, params=params, names=names,
                       batch_inputs=batch, traced_batch=BATCH, microbatch=MICRO,
                       fake_inputs=inputs, num_stages=2)
    records = []
    for passes in (LOSS_PASSES, NORMALIZE_PASSES, HOIST_PASSES, STAGE_PASSES):
        gm, found = run_passes(gm, ctx, passes)
        records += found
    assert [r.pass_name for r in records] == ["keep_loss_output", "normalize_loss",
                                              "hoist_unshards", "microbatch_graph",
                                              "split_stages"]
    assert ctx.normalization.kind == "token_mean" and ctx.hoisted == {}
    resize = records[3]
    assert dict(resize.stats)["ratio"] == 2 and dict(resize.stats)["resized"] > 0
    assert resize.before != resize.after  # the views' batch size
    assert len(ctx.split.stages) == 2 and gm.stage1 is ctx.split.stages[1].gm
    micro = [v[:MICRO] if i in batch else v for i, v in enumerate(inputs)]
    (numerator,) = gm(*micro)
    tokens = ctx.normalization.denominator(*micro)
    torch.testing.assert_close(numerator / tokens, model(x[:MICRO], y[:MICRO]))


def test_split_stages_needs_the_micro_batch_graph_first() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    ctx = FrontContext(config=Config.build(), graph_name="t", kind="front")
    with pytest.raises(PassOrderError, match="microbatch_graph"):
        run_passes(gm, ctx, (split_stages,))
    with pytest.raises(TypeError, match="pipeline front pass"):
        split_stages(gm, PassContext(config=Config.build(), graph_name="t", kind="front"))


class Program:
    """A tiny IR that is not a graph: a list of steps."""

    def __init__(self, steps: tuple[str, ...]) -> None:
        self.steps = steps

    def pass_text(self) -> str:
        return "\n".join(self.steps)

    def pass_size(self) -> int:
        return len(self.steps)

    def pass_check(self) -> None:
        if len(set(self.steps)) != len(self.steps):
            raise ValueError(f"a step twice: {self.steps}")


def add_send(program: Program, ctx: PassContext) -> PassResult:
    return PassResult(Program((*program.steps, "send")), True, {"added": 1})


def keep(program: Program, ctx: PassContext) -> PassResult:
    return PassResult(program, False)


def test_run_passes_takes_a_pass_subject() -> None:
    ctx = PassContext(config=None, graph_name="p.program", kind="program")
    program, records = run_passes(Program(("forward",)), ctx, (add_send, keep))
    assert program.steps == ("forward", "send")
    assert [(r.pass_name, r.nodes_before, r.nodes_after, r.changed) for r in records] == [
        ("add_send", 1, 2, True), ("keep", 2, 2, False)]
    assert records[0].before == "forward" and records[0].after == "forward\nsend"
    assert PassResult(program, False).ir is program
    _, unrecorded = run_passes(Program(("forward",)), ctx, (add_send,), record=False)
    assert unrecorded[0].after == "" and unrecorded[0].nodes_after == 2
    with pytest.raises(ValueError, match="a step twice"):  # pass_check runs after each pass
        run_passes(Program(("send",)), ctx, (add_send,))
    with pytest.raises(TypeError, match="neither an fx.GraphModule nor a PassSubject"):
        run_passes(Program(("forward",)), ctx, (lambda p, c: PassResult(p.steps, True),))
    with pytest.raises(TypeError, match="fx.GraphModule or a PassSubject"):
        run_passes(("forward",), ctx, (keep,))


def _naive_partition(costs: list[float], parts: int) -> list[int]:
    """The plain O(parts n^2) linear-partition program: the first minimiser at every step."""
    n, prefix = len(costs), [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def test_partition_is_the_linear_partition_program() -> None:
    rng = random.Random(0)
    for trial in range(400):
        n = rng.randint(1, 30)
        if trial % 3 == 0:  # ties everywhere
            costs = [float(rng.randint(0, 3)) for _ in range(n)]
        else:
            costs = [rng.random() * 10 ** rng.randint(-3, 6) for _ in range(n)]
        parts = rng.randint(1, n)
        assert partition_costs(costs, parts) == _naive_partition(costs, parts), (costs, parts)
    with pytest.raises(ValueError, match="cannot cut 2 costs into 3"):
        partition_costs([1.0, 2.0], 3)


def test_the_screen_cuts_stages_as_the_compiler_does() -> None:
    from types import SimpleNamespace

    def op(flops: float) -> SimpleNamespace:
        return SimpleNamespace(flops=flops, bytes=0)

    # Without repeated blocks: between any two ops, on their times.
    times = [1.0, 1.0, 1.0, 10.0, 1.0]
    plain = SimpleNamespace(forward=[op(t) for t in times], block_starts=())
    cut = tune_screen._cut(plain, times, 2)
    starts = partition_costs(times, 2)
    assert [start for start, _ in cut] == starts == [0, 3]
    assert max(sum(times[a:b]) for a, b in cut) == 11.0  # an even split of the time gives 13
    two = SimpleNamespace(forward=[op(1), op(2)], block_starts=())
    assert tune_screen._cut(two, [1.0, 2.0], 3) == [(0, 1), (1, 2), (2, 2)]
    # With blocks: only in front of a block, balancing the blocks' costs (what precedes the
    # first block goes with it), as the stage split does; too few blocks raise.
    blocks = SimpleNamespace(forward=[op(f) for f in (1, 4, 1, 1, 4, 1)], block_starts=(1, 2, 4))
    cut = tune_screen._cut(blocks, [0.0] * 6, 2)
    assert cut[0][0] == 0 and cut[1][0] in (2, 4) and cut[1][1] == 6  # block starts only
    assert max(sum(o.flops for o in blocks.forward[a:b]) for a, b in cut) == 7
    with pytest.raises(ValueError, match="3 blocks for 4 pipeline stages"):
        tune_screen._cut(blocks, [0.0] * 6, 4)
