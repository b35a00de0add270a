"""The frozen Program and the one stage compiler (``runtime/program.py``,
``compiler/frontend/stage_compiler.py``).

- pp = 1: the session's Program of a compiled model prints its graphs by name (FileCheck),
  has autograd's schedule (``schedule=None``), and gains its backward as a new Program when
  the first backward compiles it; a Program and its mappings cannot be changed.
- pp = 2 with DualPipeV and ``pp_reshard=True`` (a planned world on fake tensors; the
  collectives inside the stage graphs, so the overlapped actions run as F&B graphs): the
  program passes
  (``split_weight_grad``, ``overlap_fb``, ``comm_lowering``) have rows in the plan's pass
  table with their stats and before/after text; the Program that runs holds every stage's
  I/W and F&B graphs and the lowered schedule.
- Both paths compile through ``StageCompiler``: a stage's forward gets the same pass sequence
  at pp = 1 as at pp = 2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models.gpt import GPT, GPTConfig
from torch.testing import FileCheck

import zeroc
from zeroc.frontend.session import SESSION_ATTR, CompileSession, wrapper_of
from zeroc.frontend.stage_compiler import StageCompiler
from zeroc.runtime.actions import ActionKind
from zeroc.runtime.program import Program

PROGRAM_PASSES = ("split_weight_grad", "overlap_fb", "comm_lowering")


def make_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32), seed=5)


def batch(size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (size, 17), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _session(compiled: torch.nn.Module) -> CompileSession:
    return getattr(wrapper_of(compiled), SESSION_ATTR)


@pytest.fixture(scope="module")
def pipelined(request) -> tuple[zeroc.Plan, list[Program], list[str]]:
    """A planned pp=2 DualPipeV world: its plan, the Programs its positions ran and the kinds
    of graph every ``StageCompiler.graph`` call compiled."""
    programs: list[Program] = []
    compiled_kinds: list[str] = []
    set_program, graph = CompileSession.set_program, StageCompiler.graph
    patch = pytest.MonkeyPatch()

    def keeping(self, program, executor=None):
        programs.append(program)
        return set_program(self, program, executor)

    def counting(self, gm, kind):
        compiled_kinds.append(f"{self.name}.{kind}")
        return graph(self, gm, kind)

    patch.setattr(CompileSession, "set_program", keeping)
    patch.setattr(StageCompiler, "graph", counting)
    try:
        plan = zeroc.explain(make_gpt(), batch(), world=2, pp=2, zero=3, device="cpu",
                             options={"schedule": "dualpipev", "microbatches": 4,
                                      "pp_reshard": True, "record_graphs": True})
    finally:
        patch.undo()
    return plan, programs, compiled_kinds


def test_pp1_program_prints_its_graphs_and_grows_by_new_programs() -> None:
    model = make_gpt()
    compiled = torch.compile(model, backend="zeroc")
    x, y = batch(4)
    loss = compiled(x, y)
    session = _session(compiled)
    before = session.programs["g0"]
    assert before.schedule is None and before.pipeline is None  # autograd's schedule
    assert list(before.graphs) == ["g0.forward"]  # the backward compiles on loss.backward()
    loss.backward()
    after = session.programs["g0"]
    assert after is not before and list(before.graphs) == ["g0.forward"]
    assert list(after.graphs) == ["g0.forward", "g0.backward"]
    [stage] = after.stages
    assert stage.forward is not None and stage.backward is not None
    text = str(after)
    (FileCheck().check("program g0: stages s0; schedule: autograd's")
     .check("graph g0.forward:").check("aten.mm").check("graph g0.backward:")
     .check("aten.mm").run(text))
    assert after.pass_text() == text
    assert after.pass_size() == sum(
        sum(1 for n in g.graph.nodes if n.op not in ("placeholder", "output"))
        for g in after.graphs.values()) > 0
    after.pass_check()


def test_pp1_no_grad_program_holds_the_inference_graph() -> None:
    compiled = torch.compile(make_gpt(), backend="zeroc")
    with torch.no_grad():
        compiled(*batch(4))
    [program] = _session(compiled).programs.values()
    assert list(program.graphs) == [f"{program.name}.inference"]
    assert program.stages[0].inference is not None and program.stages[0].forward is None
    FileCheck().check(f"graph {program.name}.inference:").check("aten.mm").run(str(program))


def test_program_is_frozen() -> None:
    model = make_gpt()
    compiled = torch.compile(model, backend="zeroc")
    compiled(*batch(4)).backward()
    program = _session(compiled).programs["g0"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.name = "g1"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.stages[0].forward = None  # type: ignore[misc]
    with pytest.raises(TypeError):
        program.graphs["g0.extra"] = program.graphs["g0.forward"]  # type: ignore[index]
    with pytest.raises(TypeError):
        program.stages[0].overlapped[1] = None  # type: ignore[index]


def test_a_graph_compiled_later_gives_a_new_program() -> None:
    """pp > 1's inference graphs compile on the first no_grad call (``StageCompiler.
    compiled_later`` -> ``CompileSession.add_graph``): a new Program takes the old one's place."""
    compiled = torch.compile(make_gpt(), backend="zeroc")
    compiled(*batch(4)).backward()
    session = _session(compiled)
    old = session.programs["g0"]
    session.add_graph("g0", "g0.s0.inference", old.graphs["g0.forward"])
    new = session.programs["g0"]
    assert new is not old and "g0.s0.inference" not in old.graphs
    assert list(new.graphs) == [*old.graphs, "g0.s0.inference"]
    assert new.stages == old.stages


def test_the_plan_is_read_from_the_programs() -> None:
    """``zeroc.explain`` builds the Plan from the Programs the session runs (their frozen
    records), not from the build records: dropping those changes nothing, and a Program
    replaced by one without its record takes its rows out of the plan."""
    compiled = torch.compile(make_gpt(), backend="zeroc")
    compiled(*batch(4)).backward()
    session = _session(compiled)
    program = session.programs["g0"]
    assert {g.name for g in program.record.graphs} == {"g0.forward", "g0.backward"}
    assert program.record.kernels and program.record.passes
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.record.kernels = ()  # type: ignore[misc]
    before = zeroc.explain(compiled).to_json()
    session.building.clear()
    assert zeroc.explain(compiled).to_json() == before
    session.programs["g0"] = dataclasses.replace(
        program, record=dataclasses.replace(program.record, kernels=(), passes=()))
    plan = zeroc.explain(compiled)
    assert not plan.kernels and not plan.passes and len(plan.graphs) == 3  # joint, F, B


def test_pass_check_finds_an_inconsistent_program() -> None:
    model = make_gpt()
    compiled = torch.compile(model, backend="zeroc")
    compiled(*batch(4)).backward()
    program = _session(compiled).programs["g0"]
    twice = dataclasses.replace(program, stages=program.stages * 2)
    with pytest.raises(ValueError, match="appears twice"):
        twice.pass_check()
    half = dataclasses.replace(program, stages=(dataclasses.replace(
        program.stages[0], input_grad=program.stages[0].backward),))
    with pytest.raises(ValueError, match="only one of"):
        half.pass_check()


def test_pp2_program_passes_have_rows_in_the_pass_table(pipelined) -> None:
    plan, _, _ = pipelined
    rows = [p for p in plan.passes if p.graph.endswith(".program")]
    assert [p.pass_name for p in rows] == list(PROGRAM_PASSES)
    split, overlap, lowering = rows
    stats = {p.pass_name: dict(p.stats) for p in rows}
    assert split.changed and int(stats["split_weight_grad"]["stages"]) == 2
    assert overlap.changed and int(stats["overlap_fb"]["fb_graphs"]) >= 1
    assert lowering.changed and int(stats["comm_lowering"]["p2p_actions"]) > 0
    assert int(stats["comm_lowering"]["fb_merged_here"]) >= 1
    # Before/after text: the I/W graphs appear, then the F&B graph, then the p2p actions.
    assert ".input_grad:" not in split.before and ".input_grad:" in split.after
    assert ".fb" not in overlap.before.split("graph ", 1)[0]
    FileCheck().check("graph g0.s").check(".fb").run(overlap.after)
    assert "SEND_F" not in lowering.before and "SEND_F" in lowering.after
    assert split.nodes_after > split.nodes_before  # I and W add graphs


def test_pp2_program_that_runs_holds_the_passes_products(pipelined) -> None:
    _, programs, _ = pipelined
    running = [p for p in programs if p.schedule is not None]
    assert running
    for program in running:
        assert program.pipeline is not None
        assert any(a.is_p2p for a in program.pipeline.schedule.actions[program.pipeline.position])
        assert not any(a.is_p2p for actions in program.schedule.actions for a in actions)
        for stage in program.stages:
            assert stage.input_grad is not None and stage.weight_grad is not None
            assert program.graph_name(stage.index, "weight_grad") in program.graphs
        fb = {(a.stage, a.b_stage) for a in program.schedule.actions[program.pipeline.position]
              if a.kind is ActionKind.FB}
        assert fb and all(b in program.stage_map()[f].overlapped for f, b in fb)
        text = str(program)
        FileCheck().check("schedule dualpipev").check("SEND_F").check("graph g0.s").run(text)
        program.pass_check()


def test_both_paths_compile_through_the_one_stage_compiler(pipelined) -> None:
    plan, _, compiled_kinds = pipelined
    assert {k.rpartition(".")[2] for k in compiled_kinds} >= {"forward", "backward"}
    model = make_gpt()
    compiled = torch.compile(model, backend="zeroc", options={"record_graphs": True})
    compiled(*batch(4)).backward()
    single = zeroc.explain(compiled)

    def sequence(passes, graph: str) -> list[str]:
        return [p.pass_name for p in passes if p.graph == graph]

    pp1 = sequence(single.passes, "g0.forward")
    pp2 = sequence(plan.passes, "g0.s0.forward")
    assert pp1 and pp1 == pp2
    assert sequence(single.passes, "g0.joint") == sequence(plan.passes, "g0.s0.joint")
