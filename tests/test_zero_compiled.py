"""Compiled ZeRO on gloo ranks: parity with single-process eager, counted collectives and bytes.

One 2-rank job (module fixture) trains the zoo GPT through ``torch.compile(...,
backend="zeroc")`` at every ZeRO stage and the zoo Llama at ZeRO-3, each rank on its slice of
the global batch, and returns losses, full state dicts, the plan's collectives and the
model-state bytes that exist on the rank. The tests compare them with single-process eager on
the global batch and with the ZeRO paper's arithmetic. A 4-rank job repeats that for the GPT
at ZeRO-1 and ZeRO-3, so every figure that divides by the ranks is checked at N=4 too.

Not run here: the Llama at ZeRO 0 to 2 (the stages' graphs do not depend on the model: the
GPT runs them, and the Llama's own parts, untied head and rotary buffers, run at ZeRO-3,
the stage that gathers every parameter); ZeRO-0 and ZeRO-2 at 4 ranks (ZeRO-0's figures do not
depend on N and run at 2 ranks; ZeRO-2 holds what ZeRO-3 holds at rest, checked at N=4, and
moves what ZeRO-1 moves, checked at N=4).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from parity import ADAM, assert_tensors_match

from zeroc.passes.zero_buckets import module_unit

STEPS = 3
GLOBAL_BATCH = 8
MODELS = {
    "gpt": lambda: GPT(GPTConfig.tiny(), seed=5),
    "llama": lambda: Llama(LlamaConfig.tiny(), seed=6),
}


def global_batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS batches of (tokens, targets) for the model ``name``."""
    model = MODELS[name]()
    vocab, seq = model.config.vocab_size, model.config.block_size
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (STEPS, GLOBAL_BATCH, seq + 1), generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def eager_reference(name: str, autocast: bool = False
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process eager training on the global batch (the forward under CPU bf16 autocast
    with ``autocast``)."""
    model = MODELS[name]()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    losses = []
    for tokens, targets in global_batches(name):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters (their flat buffers), gradients and Adam moments on this rank."""
    from zeroc.sharding.sharded_params import sharded_of

    def local(value: torch.Tensor) -> torch.Tensor:
        return value.to_local() if hasattr(value, "to_local") else value

    total = 0
    for param in model.parameters():
        flat = sharded_of(param).flat
        total += flat.numel() * flat.element_size()
        if param.grad is not None:
            total += local(param.grad).numel() * param.grad.element_size()
        for key in ("exp_avg", "exp_avg_sq"):
            moment = local(optimizer.state[param][key])
            total += moment.numel() * moment.element_size()
    return total


def measured_at_rest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the storages behind this rank's parameters, gradients and Adam moments."""
    from zeroc.sharding.sharded_params import sharded_of

    def local(value: torch.Tensor) -> torch.Tensor:
        return value.to_local() if hasattr(value, "to_local") else value

    storages: dict[int, int] = {}
    for param in model.parameters():
        tensors = [sharded_of(param).flat]
        if param.grad is not None:
            tensors.append(local(param.grad))
        tensors += [local(optimizer.state[param][k]) for k in ("exp_avg", "exp_avg_sq")]
        for tensor in tensors:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def train_compiled(rank: int, world: int, name: str, zero: int, options: dict,
                   mixed_precision: str | None = None, inspect=None) -> dict:
    """Train ``name`` compiled at ``zero`` on this rank's slice; return what the tests check
    (and ``inspect(compiled)`` after the steps, if given)."""
    import zeroc
    from zeroc.sharding.parallelize import parallelize
    from zeroc.sharding.state_dict import full_state_dict

    torch._dynamo.reset()
    model = MODELS[name]()
    parallelize(model, zero=zero, mixed_precision=mixed_precision)
    compiled = torch.compile(model, backend="zeroc", options=options)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    per_rank = GLOBAL_BATCH // world
    losses = []
    for tokens, targets in global_batches(name):
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = compiled(tokens[rows], targets[rows])
        loss.backward()
        optimizer.step()
        if len(losses) == STEPS - 1:
            held = state_bytes(model, optimizer)
            held_at_rest = measured_at_rest(model, optimizer)
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    plan = zeroc.explain(compiled)
    return {
        "losses": losses,
        "full": {k: v.clone() for k, v in full_state_dict(model).items()},
        "collectives": [(c.graph, c.op, c.bytes, len(c.params)) for c in plan.collectives],
        "bucket_params": [c.params for c in plan.collectives],
        "dtypes": [c.dtype for c in plan.collectives],
        "meta": (plan.meta.world_size, plan.meta.mesh, plan.meta.zero),
        "state_bytes": held if zero == 3 else None,
        "at_rest": held_at_rest,
        "plan_memory": [(m.params, m.grads, m.optimizer, m.moved) for m in plan.memory
                        if m.rank == rank],  # the plan has a row per data-parallel rank
        "numel": sum(r.numel for r in model._zeroc_layout.params),
        "padded_numel": sum(p.padded_numel for p in model._zeroc_layout.params),
        "num_params": len(list(model.parameters())),
        "inspected": None if inspect is None else inspect(compiled),
    }


# (model, ZeRO stage) at 2 ranks: every stage on the GPT, ZeRO-3 on the Llama.
TWO_RANK_CASES = (("gpt", 0), ("gpt", 1), ("gpt", 2), ("gpt", 3), ("llama", 3))


def two_rank_job(rank: int, world: int) -> dict:
    results = {}
    for name, zero in TWO_RANK_CASES:
        results[(name, zero)] = train_compiled(rank, world, name, zero, {"bucket_mb": 0.01})
    results["large_buckets"] = train_compiled(rank, world, "gpt", 3,
                                              {"bucket_mb": 1000, "fused_loss": True})
    results["bf16"] = train_compiled(rank, world, "gpt", 3, {}, mixed_precision="bf16")
    results["int8_gathers"] = train_compiled(rank, world, "gpt", 3,
                                             {"bucket_mb": 0.01, "gather_quant": "int8"})
    results["int4_reduce"] = train_compiled(rank, world, "gpt", 2, {
        "bucket_mb": 0.01, "gather_quant": "int8", "reduce_quant": "int4"})
    return results


# At 4 ranks (among the suite's slowest cases): the GPT at ZeRO-1 and ZeRO-3, the stages whose
# figures at N=4 the others' follow from (the module docstring says which).
FOUR_RANK_CASES = (("gpt", 1), ("gpt", 3))


def four_rank_job(rank: int, world: int) -> dict:
    return {(name, zero): train_compiled(rank, world, name, zero, {"bucket_mb": 0.01})
            for name, zero in FOUR_RANK_CASES}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(two_rank_job, 2, timeout=900)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(four_rank_job, 4, timeout=1500)


def check_parity(got: dict, name: str, zero: int, world: int) -> None:
    ref_losses, ref_state = eager_reference(name)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)
    assert_tensors_match(ref_state, got["full"], f"{name} zero={zero} on {world} ranks")
    assert got["meta"] == (world, (("pp", 1), ("dp", world)), zero)


@pytest.mark.slow
@pytest.mark.timeout(1000)
@pytest.mark.parametrize(("name", "zero"), TWO_RANK_CASES)
def test_two_ranks_match_eager_global_batch(two_ranks, name: str, zero: int) -> None:
    check_parity(two_ranks[0][(name, zero)], name, zero, 2)


@pytest.mark.slow
@pytest.mark.timeout(1600)
@pytest.mark.parametrize(("name", "zero"), FOUR_RANK_CASES)
def test_four_ranks_match_eager_global_batch(four_ranks, name: str, zero: int) -> None:
    check_parity(four_ranks[0][(name, zero)], name, zero, 4)


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_bf16_within_bf16_tolerance_of_eager_autocast(two_ranks) -> None:
    """bf16 compute with fp32 master shards (every op in bf16, as FSDP2's bf16 policy; eager
    autocast keeps norms and the loss in fp32): losses within torch.testing's bf16 tolerance
    (rtol 1.6e-2) of eager autocast; weights
    within 2 STEPS lr (Adam moves a weight by about lr whatever its gradient's size, so a tiny
    gradient whose sign differs between two bf16 paths costs up to 2 lr per step)."""
    ref_losses, ref_state = eager_reference("gpt", autocast=True)
    got = two_ranks[0]["bf16"]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses),
                               rtol=1.6e-2, atol=1e-5)
    for key, value in ref_state.items():
        assert got["full"][key].dtype == torch.float32
        torch.testing.assert_close(got["full"][key], value, rtol=0, atol=2 * STEPS * ADAM["lr"],
                                   msg=key)


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_int8_gathers_move_under_a_third_and_train_close_to_eager(two_ranks) -> None:
    """``gather_quant="int8"`` at ZeRO-3: the same buckets, every one large enough to gain
    gathered as int8 blocks and scales (the layer norms' stay float32), the reductions
    unchanged; the lossy gathered weights move the loss by far less than a step does."""
    exact, quant = two_ranks[0][("gpt", 3)], two_ranks[0]["int8_gathers"]
    assert [c[:2] for c in quant["collectives"]] == [c[:2] for c in exact["collectives"]]
    moved = {}
    for run, key in ((exact, "exact"), (quant, "int8")):
        for (graph, op, nbytes, _n), dtype in zip(run["collectives"], run["dtypes"], strict=True):
            phase = (key, graph.split(".")[1], op)
            moved[phase] = moved.get(phase, 0) + nbytes
            if key == "int8" and op == "reduce_scatter":
                assert dtype == "float32"
    assert {d for d, (_, op, _, _) in zip(quant["dtypes"], quant["collectives"], strict=True)
            if op == "all_gather"} == {"int8", "float32"}
    for phase in ("forward", "backward"):
        assert moved[("int8", phase, "all_gather")] * 3 < moved[("exact", phase, "all_gather")]
    assert moved[("int8", "backward", "reduce_scatter")] == moved[
        ("exact", "backward", "reduce_scatter")]
    ref_losses, ref_state = eager_reference("gpt")
    torch.testing.assert_close(torch.tensor(quant["losses"]), torch.tensor(ref_losses),
                               rtol=1e-3, atol=0)
    assert quant["losses"] != exact["losses"]  # the gathered weights were the int8 ones
    for key, value in ref_state.items():  # Adam's steps: at most about lr each
        torch.testing.assert_close(quant["full"][key], value, rtol=0,
                                   atol=2 * STEPS * ADAM["lr"], msg=key)


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_int4_reductions_move_under_a_seventh_and_train_close_to_eager(two_ranks) -> None:
    """``reduce_quant="int4"`` (with int8 gathers) at ZeRO-2: the same buckets, every
    reduction an all-to-all of int4 rows (4 bits per element and a float32 scale per 256),
    under a seventh of the float32 reduce-scatter's bytes; losses close to eager's."""
    from zeroc.runtime.quant.gather import BLOCK
    from zeroc.runtime.quant.reduce import row_bytes

    exact, quant = two_ranks[0][("gpt", 2)], two_ranks[0]["int4_reduce"]
    assert [c[:2] for c in quant["collectives"]] == [c[:2] for c in exact["collectives"]]
    reductions = [(c, d, e) for c, d, e in zip(quant["collectives"], quant["dtypes"],
                                                exact["collectives"], strict=True)
                  if c[1] == "reduce_scatter"]
    assert {d for _, d, _ in reductions} == {"int4", "float32"}
    for (_g, _op, nbytes, _n), dtype, (_g2, _op2, exact_bytes, _n2) in reductions:
        width = exact_bytes // 4 // 2  # float32 elements of one rank's piece
        if dtype == "int4":
            assert nbytes == 2 * row_bytes(width, 4, BLOCK) < exact_bytes
        else:  # under about a block per rank (a layer norm's): reduced exact
            assert nbytes == exact_bytes and row_bytes(width, 4, BLOCK) >= 4 * width
    quantized = sum(c[2] for c, _, _ in reductions)
    assert quantized * 5 < sum(e[2] for _, _, e in reductions)
    ref_losses, _ = eager_reference("gpt")
    torch.testing.assert_close(torch.tensor(quant["losses"]), torch.tensor(ref_losses),
                               rtol=1e-3, atol=0)
    assert quant["losses"] != exact["losses"]


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_collectives_are_counted_in_the_compiled_graphs(two_ranks) -> None:
    by_stage = {z: two_ranks[0][("gpt", z)]["collectives"] for z in (0, 1, 2, 3)}
    ops = {z: {(graph.split(".")[1], op) for graph, op, _b, _n in c} for z, c in by_stage.items()}
    assert ops[0] == {("backward", "all_reduce")}
    # ZeRO-1 keeps whole parameters: no gather in the graphs; the backward reduce-scatters the
    # gradients into the rows each rank updates, and one all-gather of updated rows runs after
    # optimizer.step() (the plan lists it as graph "optimizer.step").
    assert ops[1] == {("backward", "reduce_scatter"), ("step", "all_gather")}
    assert ops[2] == {("forward", "all_gather"), ("backward", "reduce_scatter")}
    # DeepSpeed's ZeRO-1 moves what ZeRO-2 moves (a reduce-scatter and an all-gather of the
    # row-padded parameters, DDP's traffic), not an all-reduce and an all-gather.
    moved = {z: sum(b for _g, _op, b, _n in by_stage[z]) for z in (0, 1, 2)}
    assert moved[1] == moved[2], moved
    assert moved[1] < 1.1 * moved[0], moved
    assert ops[3] == {("forward", "all_gather"), ("backward", "all_gather"),
                      ("backward", "reduce_scatter")}
    # The forward gathers every parameter once and every parameter is reduced once (a tied
    # embedding/head included); the backward gathers again only what it reads.
    params = {}
    for graph, op, _bytes, count in by_stage[3]:
        key = (graph.split(".")[1], op)
        params[key] = params.get(key, 0) + count
    shards = two_ranks[0][("gpt", 3)]["num_params"]
    assert params[("forward", "all_gather")] == params[("backward", "reduce_scatter")] == shards
    assert 0 < params[("backward", "all_gather")] < shards
    # One bucket when the cap is large: one collective per phase.
    # Buckets never mix modules (one block's parameters at a time, as FSDP): with a cap that
    # holds the whole model, one collective per module and phase. The backward regathers
    # every module but the embeddings: it does not read the position embedding, and the token
    # embedding's weight is read only as the tied head, whose gradient the fused loss
    # (zeroc::linear_cross_entropy) computed in the forward.
    large = two_ranks[0]["large_buckets"]
    for params in large["bucket_params"]:
        assert len({module_unit(p) for p in params}) == 1, params
    per_phase = {}
    for graph, op, _b, _n in large["collectives"]:
        per_phase[(graph.split(".")[1], op)] = per_phase.get((graph.split(".")[1], op), 0) + 1
    units = {"tok_emb", "pos_emb", "layers.0", "layers.1", "ln_f"}
    assert per_phase == {("forward", "all_gather"): len(units),
                         ("backward", "all_gather"): len(units) - 2,
                         ("backward", "reduce_scatter"): len(units)}


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_stage3_moves_one_and_a_half_times_stage0(two_ranks) -> None:
    """ZeRO paper: stage 0 moves 2 Psi, stage 3 3 Psi. The backward regathers only what it
    reads (not biases or position embeddings), so stage 3 moves 2 Psi + the bytes of those."""
    got = {z: two_ranks[0][("gpt", z)] for z in (0, 3)}
    padded = got[3]["padded_numel"] * 4
    unpadded = sum(v.numel() for k, v in eager_reference("gpt")[1].items()
                   if k != "lm_head.weight") * 4
    moved = {z: sum(b for _g, _op, b, _n in got[z]["collectives"]) for z in (0, 3)}
    phase = {}
    for graph, op, nbytes, _n in got[3]["collectives"]:
        key = (graph.split(".")[1], op)
        phase[key] = phase.get(key, 0) + nbytes
    assert moved[0] == 2 * unpadded
    assert phase[("forward", "all_gather")] == phase[("backward", "reduce_scatter")] == padded
    assert 0.8 * padded < phase[("backward", "all_gather")] <= padded
    assert moved[3] == 2 * padded + phase[("backward", "all_gather")]
    ratio = moved[3] / moved[0]
    assert 1.4 < ratio <= 1.5 * padded / unpadded
    for name in MODELS:  # every stage-3 run, both models: at most 1.5x (plus padding)
        run = two_ranks[0][(name, 3)]
        pad = run["padded_numel"] * 4
        assert sum(b for _g, _op, b, _n in run["collectives"]) <= 3 * pad


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_zero3_state_on_a_rank_is_16_psi_over_nd(two_ranks) -> None:
    """Rank 0 owns ceil(d0 / 2) rows of every parameter: 16 bytes per element of its padded
    shard. Rank 1 owns the rest: its gradients and moments cover only its real rows."""
    got = [two_ranks[rank][("gpt", 3)] for rank in (0, 1)]
    padded = got[0]["padded_numel"]
    numel = sum(v.numel() for k, v in eager_reference("gpt")[1].items() if k != "lm_head.weight")
    assert got[0]["state_bytes"] == 16 * padded // 2
    assert got[0]["state_bytes"] + got[1]["state_bytes"] == 4 * padded + 12 * numel


def check_stage_figures(results: list[dict], world: int,
                        cases: tuple[tuple[str, int], ...]) -> None:
    """Per (model, stage) of ``cases``: the plan's bytes at rest equal what the rank holds,
    and the plan's bytes moved per step follow the ZeRO arithmetic (Psi fp32 elements, N
    ranks)."""
    for name in dict.fromkeys(name for name, _ in cases):
        stages = [zero for model, zero in cases if model == name]
        got = {z: [r[(name, z)] for r in results] for z in stages}
        psi = got[stages[0]][0]["numel"] * 4
        for zero in stages:
            for rank_result in got[zero]:
                params, grads, optimizer, moved = rank_result["plan_memory"][0]
                assert params + grads + optimizer == rank_result["at_rest"], (name, zero)
        rest = {z: sum(sum(m[0][:3]) for m in (r["plan_memory"] for r in got[z])) / world
                for z in got}
        moved = {z: got[z][0]["plan_memory"][0][3] for z in got}
        padded = got[3][0]["padded_numel"] * 4  # every model of cases runs ZeRO-3
        if 0 in got:
            assert rest[0] == 4 * psi and moved[0] == 2 * psi
        # ZeRO-1: whole parameters, this rank's rows of gradients and moments; DeepSpeed's
        # traffic (a reduce-scatter and an all-gather of the padded rows), ZeRO-2's.
        if 1 in got:
            assert rest[1] == psi + 3 * psi / world and moved[1] == 2 * padded
        if 2 in got:
            assert rest[2] == (padded + 3 * psi) / world and moved[2] == 2 * padded
        assert rest[3] == (padded + 3 * psi) / world
        assert 2 * padded < moved[3] <= 3 * padded


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_stage_memory_and_traffic_on_two_ranks(two_ranks) -> None:
    check_stage_figures(two_ranks, 2, TWO_RANK_CASES)


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_stage_memory_and_traffic_on_four_ranks(four_ranks) -> None:
    check_stage_figures(four_ranks, 4, FOUR_RANK_CASES)
