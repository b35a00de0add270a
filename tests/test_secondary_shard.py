"""hpZ: ``options={"secondary_shard": k}`` (``zeroc.runtime.secondary_shard``).

On 4 gloo ranks with ``k=2`` a ZeRO-3 GPT trains to the same losses and parameters, bit for
bit, as without it: the backward's gathers of the pieces put back the weights the forward
gathered. With bfloat16 and int8 forward gathers the backward gathers stay exact (bfloat16).
The plan shows every forward gather over the data-parallel group, every backward gather over
a node group of 2 consecutive ranks, and every reduction over the data-parallel group. In a
planned 16-GPU world (fake CUDA, NCCL's rules checked) the same holds with ``k=8``, the
pieces are what the forward saves beyond ZeRO-3 (1/8 of the weights the backward reads),
and bad values are refused, naming the option.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig
from parity import ADAM
from test_torch_distributed import _mean_over_ranks, batches, make_gpt, rows

import zeroc
from zeroc.errors import OptionError
from zeroc.frontend.config import Config

VARIANTS = {  # name -> (mixed precision, options)
    "fp32": (None, {}),
    "fp32-hpz": (None, {"secondary_shard": 2}),
    "bf16-int8-hpz": (torch.bfloat16, {"gather_quant": "int8", "secondary_shard": 2}),
}


def four_rank_job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from zeroc.runtime.mesh import resolve_group
    from zeroc.runtime.secondary_shard import secondary_groups

    out: dict = {}
    for name, (dtype, options) in VARIANTS.items():
        torch._dynamo.reset()
        precision = zeroc.MixedPrecision(param_dtype=dtype) if dtype else None
        model = zeroc.parallelize(make_gpt(), zero=3, mixed_precision=precision)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
        compiled = torch.compile(model, backend="zeroc", options=options)
        losses = []
        for index in range(3):
            loss = compiled(*rows(batches()[index], rank, world))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(_mean_over_ranks(loss))
        plan = zeroc.explain(compiled)
        out[name] = {"losses": losses, "full": zeroc.full_state_dict(model),
                     "over": sorted({(c.graph.rsplit(".", 1)[-1], c.op, c.mesh_dim, c.dtype)
                                     for c in plan.collectives})}
    out["groups"] = sorted(tuple(dist.get_process_group_ranks(resolve_group(name)))
                           for name in secondary_groups())
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hpz_trains_as_zero3_and_regathers_inside_the_node() -> None:
    ranks = run_ranks(four_rank_job, 4, timeout=500)
    for rank in ranks:
        assert rank["fp32-hpz"]["losses"] == rank["fp32"]["losses"]
        for key, value in rank["fp32"]["full"].items():
            assert torch.equal(rank["fp32-hpz"]["full"][key], value), key
        # int8 forward gathers: the pieces are cut from the dequantized weights, so the
        # backward reads the forward's own weights; the node gathers stay exact (bf16). The
        # loss is a bfloat16, whose steps near 4 are 1/32.
        assert rank["bf16-int8-hpz"]["losses"] == pytest.approx(rank["fp32"]["losses"],
                                                                 abs=0.05)
    assert ranks[0]["fp32"]["over"] == [("backward", "all_gather", "dp", "float32"),
                                        ("backward", "reduce_scatter", "dp", "float32"),
                                        ("forward", "all_gather", "dp", "float32")]
    assert ranks[0]["fp32-hpz"]["over"] == [("backward", "all_gather", "node", "float32"),
                                            ("backward", "reduce_scatter", "dp", "float32"),
                                            ("forward", "all_gather", "dp", "float32")]
    assert ranks[0]["bf16-int8-hpz"]["over"] == [
        ("backward", "all_gather", "node", "bfloat16"),
        ("backward", "reduce_scatter", "dp", "bfloat16"),
        ("forward", "all_gather", "dp", "bfloat16"), ("forward", "all_gather", "dp", "int8")]
    # Rank r's node group is ranks 2 * (r // 2) and the next.
    assert [r["groups"] for r in ranks] == [[(0, 1)], [(0, 1)], [(2, 3)], [(2, 3)]]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (32, 17), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32), seed=1)


@pytest.mark.timeout(600)
def test_a_planned_world_gathers_the_backward_in_nodes_and_saves_the_pieces() -> None:
    plans = {k: zeroc.explain(_gpt(), _batch(), world=16, zero=3, device="cuda",
                              options={"secondary_shard": k, "activation_recompute": False})
             for k in (None, 8)}
    hpz = plans[8]
    gathers = [c for c in hpz.collectives if c.op == "all_gather"]
    assert {c.mesh_dim for c in gathers if c.graph.endswith("forward")} == {"dp"}
    assert {c.mesh_dim for c in gathers if c.graph.endswith("backward")} == {"node"}
    assert {c.mesh_dim for c in hpz.collectives if c.op == "reduce_scatter"} == {"dp"}
    # The backward re-gathers the weights it reads (not embeddings, biases: their gradients
    # need no weight), whole, as ZeRO-3 does over the data-parallel group.
    plain = [c for c in plans[None].collectives if c.op == "all_gather"]
    backward = [(c.params, c.bytes) for c in gathers if c.graph.endswith("backward")]
    assert backward == [(c.params, c.bytes) for c in plain if c.graph.endswith("backward")]
    assert "node: 8 (hpZ: consecutive dp ranks)" in " ".join(str(hpz).split())
    # The forward saves each rank's piece of those weights: 1/8 of them, whole rows.
    shapes = {name: p.shape for name, p in _gpt().named_parameters()}
    pieces = sum(-(-shapes[n][0] // 8) * shapes[n][1:].numel() * 4
                 for params, _ in backward for n in params)
    assert hpz.memory[0].activations - plans[None].memory[0].activations == pieces
    assert ("keep_read_secondary_shards", "unread_pieces_dropped") in {
        (p.pass_name, key) for p in hpz.passes for key in dict(p.stats)}


@pytest.mark.parametrize("value", [1, 0, True, 2.0, "2"])
def test_bad_secondary_shard_values_are_named(value) -> None:
    with pytest.raises(OptionError, match=rf"secondary_shard={value!r}"):
        Config.build(options={"secondary_shard": value})


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "pp", "zero", "k", "message"), [
    (4, 1, 2, 2, "parallelized with zero=2, pp=1"),
    (8, 2, 3, 2, "parallelized with zero=3, pp=2"),
    (4, 1, 3, 3, r"must divide the data-parallel size 4 .*allowed: \[2\]"),
    (4, 1, 3, 4, r"must divide the data-parallel size 4 .*allowed: \[2\]"),
])
def test_secondary_shard_where_it_cannot_apply_is_refused(world, pp, zero, k, message) -> None:
    with pytest.raises(OptionError, match=message):
        zeroc.explain(_gpt(), _batch(), world=world, pp=pp, zero=zero, device="cuda",
                      options={"secondary_shard": k})
