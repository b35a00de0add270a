"""Planning a world that is not there: ``zeroc.explain(model, inputs, world=W, ...)``.

The fake plan of the zoo GPT at world 2 (ZeRO-3) is compared with a real 2-rank gloo run of
the same model: the same graphs (their code), the same collectives (op and bytes), the same
bytes held at rest, and a peak (both measured by ``measured_step``'s ``StepMemory`` tracker,
on real and on fake tensors) within 5% of the real one; the same at pp=2 x dp=2 with
DualPipeV against a real 4-rank run. At pp=2 x dp=2 every rank's row holds
16 bytes x its stages' parameters / dp. A meta Hugging Face Llama (``use_cache`` left on) plans
at pp=1 and pp=2 with an estimated step. Bad input: pp not dividing the world, an unknown
hardware name, a model that reads a value while it runs, a process group already there.
"""

from __future__ import annotations

import difflib

import pytest
import torch
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig
from torch import nn
from torch.testing import FileCheck

import zeroc
from zeroc.runtime.cost.hardware import get_profile
from zeroc.runtime.zero_ops import padded_numel_for


def make_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32), seed=5)


def inputs(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (batch, 17), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _summary(plan) -> dict:
    return {"graphs": [(g.name, g.kind, g.code) for g in plan.graphs],
            "collectives": sorted((c.graph, c.op, c.bytes) for c in plan.collectives)}


PIPELINE = {"schedule": "dualpipev", "microbatches": 4}


def real_job(rank: int, world: int, pp: int, options: dict) -> dict:
    from zeroc.world.fake_world import measured_step

    torch._dynamo.reset()
    model = zeroc.parallelize(make_gpt(), zero=3, pp=pp)
    compiled = torch.compile(model, backend="zeroc", options=options)
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = inputs()
    compiled(x, y)  # compiles
    memory = measured_step(compiled, model, optimizer, (x, y), {}, lambda loss: loss.backward())
    return {**_summary(zeroc.explain(compiled)), "memory": memory}


def _check_against_real(world: int, pp: int, options: dict) -> None:
    """The fake plan of ``world`` ranks against a real gloo run: the same graphs and
    collectives (those of the first position), and every position's first rank holds and
    peaks at what the real rank does (within 5%: the same tracker on both)."""
    real = run_ranks(real_job, world, pp, options, timeout=300)
    plan = zeroc.explain(make_gpt(), inputs(), world=world, pp=pp, zero=3, device="cpu",
                         options=options)
    fake = _summary(plan)
    assert [g[:2] for g in fake["graphs"]] == [g[:2] for g in real[0]["graphs"]]
    for (name, _, planned), (_, _, ran) in zip(fake["graphs"], real[0]["graphs"], strict=True):
        assert planned == ran, (name, "".join(difflib.unified_diff(
            ran.splitlines(True), planned.splitlines(True), "real", "planned", n=1))[:4000])
    assert fake["collectives"] == real[0]["collectives"]
    assert [m.rank for m in plan.memory] == list(range(world))
    for rank in range(0, world, world // pp):
        row, want = plan.memory[rank], real[rank]["memory"]
        assert (row.params, row.grads, row.optimizer) == (
            want["params"], want["grads"], want["optimizer"]), rank
        assert abs(row.peak - want["peak"]) <= 0.05 * want["peak"], (rank, row.peak, want)
    assert plan.meta.world_size == world
    assert dict(plan.meta.mesh) == {"pp": pp, "dp": world // pp}


@pytest.mark.slow
def test_fake_plan_agrees_with_a_real_two_rank_run() -> None:
    _check_against_real(2, 1, {})


@pytest.mark.slow
def test_fake_pipeline_plan_agrees_with_a_real_four_rank_run() -> None:
    """pp=2 x dp=2, ZeRO-3, DualPipeV."""
    _check_against_real(4, 2, PIPELINE)


def test_pipeline_plan_rows_hold_their_stages() -> None:
    plan = zeroc.explain(make_gpt(), inputs(), world=4, pp=2, zero=3, device="cpu",
                         options={"schedule": "1f1b"})
    assert [m.rank for m in plan.memory] == [0, 1, 2, 3]
    shapes = {n: tuple(p.shape) for n, p in make_gpt().named_parameters()}
    for row in plan.memory:
        position = row.rank // 2
        names = {n for s, ranks in enumerate(plan.pipeline.placement) if position in ranks
                 for n in plan.stages[s].param_names}
        want = sum(4 * padded_numel_for(shapes[n], 2) // 2 for n in names)
        assert row.params == want and row.grads == want and row.optimizer == 2 * want, row
    total = sum(4 * p.numel() for p in make_gpt().parameters())
    assert all(m.params < 0.8 * total / 2 for m in plan.memory)


def test_bad_world_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"pp=3 is not allowed with world=4.*allowed"):
        zeroc.explain(make_gpt(), inputs(), world=4, pp=3, device="cpu")
    with pytest.raises(ValueError, match=r"h100-sxm"):
        zeroc.explain(make_gpt(), inputs(), world=2, device="cpu", hardware="v100")
    with pytest.raises(ValueError, match="device='tpu' is not allowed"):
        zeroc.explain(make_gpt(), inputs(), world=2, device="tpu")


class ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        if out.sum().item() > 0:  # data-dependent: needs a real value
            return out.square().mean()
        return out.mean()


def test_a_value_read_names_the_op() -> None:
    with pytest.raises(ValueError, match=r"reads a tensor's value.*item"):
        zeroc.explain(ReadsAValue(), (torch.ones(4, 8),), world=2, zero=3, device="cpu")


def test_plans_a_hugging_face_llama_with_labels() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=True)  # left on, as users often do: the training step makes no cache
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tokens = torch.zeros(4, 16, dtype=torch.long)
    for pp in (1, 2):
        plan = zeroc.explain(model, {"input_ids": tokens, "labels": tokens}, world=2, pp=pp,
                             zero=3, device="cpu", hardware="h100-sxm",
                             options={"schedule": "1f1b"} if pp > 1 else None)
        assert [m.rank for m in plan.memory] == [0, 1]
        assert plan.estimate is not None and plan.estimate.step_s > 0
        assert all(m.params > 0 and m.peak >= m.params for m in plan.memory)
        kinds, graphs = dict(plan.estimate.kinds), dict(plan.estimate.graphs)
        if pp == 1:  # the graphs themselves are the action kinds
            assert {"forward", "backward", "optimizer"} <= kinds.keys()
            assert kinds["forward"] == pytest.approx(graphs["g0.forward"])


def test_the_estimate_gives_each_graph_and_action_kind() -> None:
    """The step estimate per graph (one call each), per action kind on the slowest rank, and
    per step; the pipeline's p2p transfers delay the simulated step."""
    options = {"schedule": "1f1b", "microbatches": 4}
    plan = zeroc.explain(make_gpt(), inputs(), world=4, pp=2, zero=3, device="cpu",
                         hardware="h100-sxm", options=options)
    e = plan.estimate
    graphs, kinds = dict(e.graphs), dict(e.kinds)
    stage_graphs = {g.name for g in plan.graphs if g.nodes and g.kind != "joint"}
    assert stage_graphs <= graphs.keys() and all(v > 0 for v in graphs.values())
    assert any(name.startswith("g0.s1.") for name in graphs)  # the other position's stages
    assert {"F", "B", "p2p (per transfer)", "collectives (exposed)", "optimizer"} <= kinds.keys()
    compute = sum(v for k, v in kinds.items() if k in ("F", "B", "I", "W", "FB"))
    assert compute <= e.compute_s * (1 + 1e-9)  # busy time never exceeds the makespan
    # Two micro-batches' F and B per stage; each call as the graphs' estimate gives it.
    assert kinds["F"] == pytest.approx(4 * graphs["g0.s0.forward"])
    # One message per micro-batch: 2 sequences x 16 tokens x 32 fp32 activations.
    assert plan.pipeline.message_bytes == (2 * 16 * 32 * 4,)
    FileCheck().check("by action kind on the slowest rank: F").check("p2p (per transfer)") \
        .check("est. time").run(str(plan))
    # The transfer is the largest message on the links: slow links hold the pipeline up.
    from zeroc.passes.program.schedule import build_schedule
    from zeroc.runtime.cost.simulate import ActionCosts, simulate
    from zeroc.world.step_estimate import _p2p_s

    slow = get_profile({"base": "h100-sxm", "intra_node_bytes_per_s": 1e6,
                        "inter_node_bytes_per_s": 1e6})
    assert _p2p_s(plan.pipeline, 2, slow) == pytest.approx(2 * 16 * 32 * 4 / 1e6, rel=0.01)
    schedule = build_schedule("1f1b", 2, 4)
    costs = plan.pipeline.stage_costs or ((1.0, 2.0, 1.0),) * 2
    fast = simulate(schedule, ActionCosts(stages=costs)).makespan
    held = simulate(schedule, ActionCosts(stages=costs, p2p_latency=1.0)).makespan
    assert held > fast
