"""zeroc.parallelize in eager mode: ZeRO stages 0-3 on gloo ranks against single-process eager.

One 2-rank job (module fixture) trains a tiny tied-embedding GPT at every stage, checks state
dicts, meta-device init, bf16 and memory, and returns plain values the tests compare with a
single-process reference. A 4-rank job covers padding over four shards and a pp=2 mesh.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from zeroc.sharding.parallelize import parallelize
from zeroc.sharding.state_dict import full_state_dict, load_full_state_dict

VOCAB, SEQ, WIDTH, HIDDEN, BATCH, STEPS = 13, 5, 6, 5, 4, 3


class TinyGPT(nn.Module):
    """Token + position embeddings, a pre-norm MLP block, final norm, head tied to the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.fc_in = nn.Linear(WIDTH, HIDDEN)
        self.fc_out = nn.Linear(HIDDEN, WIDTH)
        self.norm_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok(tokens) + self.pos(positions)
        h = h + self.fc_out(F.gelu(self.fc_in(self.norm(h))))
        logits = self.head(self.norm_f(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return tokens, targets


def train(
    model: nn.Module, tokens, targets, autocast: bool = False
) -> tuple[list[float], object]:
    """STEPS AdamW steps; ``autocast`` runs each forward (only) under CPU bf16 autocast."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


def local_batch(rank: int, dp: int):
    tokens, targets = global_batch()
    rows = BATCH // dp
    return tokens[rank * rows : (rank + 1) * rows], targets[rank * rows : (rank + 1) * rows]


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def state_bytes(model: nn.Module, optimizer) -> int:
    """Bytes this rank holds for parameters (their flat buffers) and optimizer state."""
    layout = getattr(model, "_zeroc_layout", None)
    total = (sum(r.shard_numel * 4 for r in layout.params) if layout is not None
             else sum(p.numel() * p.element_size() for p in model.parameters()))
    for state in optimizer.state.values():
        total += sum(_local(v).numel() * v.element_size() for v in state.values()
                     if v.dim() > 0)
    return total


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient, gathered from the DTensor gradients."""
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def two_rank_checks(rank: int, world: int) -> dict:
    """Everything the 2-rank tests assert on, computed in one job."""
    out: dict = {}
    tokens, targets = local_batch(rank, world)
    for zero in (0, 1, 2, 3):
        model = parallelize(make_model(), zero=zero)
        losses, optimizer = train(model, tokens, targets)
        out[f"zero{zero}"] = {"losses": losses, "full": full_state_dict(model)}
        out[f"zero{zero}"]["kinds"] = sorted({
            (type(p).__name__, str(getattr(p, "placements", ""))) for p in model.parameters()})
        out[f"zero{zero}"]["shapes"] = [tuple(p.shape) for p in model.parameters()]
        if zero == 3:
            out["keys"] = list(model.state_dict().keys())
            out["bytes"] = state_bytes(model, optimizer)
            out["padded"] = sum(r.padded_numel for r in model._zeroc_layout.params)
            trained = model
    fresh = parallelize(make_model(seed=7), zero=3)
    load_full_state_dict(fresh, out["zero3"]["full"] if rank == 0 else None)
    out["roundtrip_shards_equal"] = all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), trained.parameters(), strict=True)
    )
    everywhere = parallelize(make_model(seed=7), zero=1)
    load_full_state_dict(everywhere, make_model(seed=3).state_dict())
    out["everywhere_full"] = full_state_dict(everywhere)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta_model = TinyGPT()
    out["meta_full"] = full_state_dict(parallelize(meta_model, zero=3))
    bf16 = parallelize(make_model(), zero=3, mixed_precision="bf16")
    bf16(tokens, targets).backward()
    out["bf16_grads"] = full_grads(bf16)
    bf16 = parallelize(make_model(), zero=3, mixed_precision="bf16")
    out["bf16_losses"], _ = train(bf16, tokens, targets)
    out["bf16_full"] = full_state_dict(bf16)
    try:
        parallelize(make_model(), pp=3)
    except ValueError as error:
        out["pp3_error"] = str(error)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(two_rank_checks, 2, timeout=180)


def reference(autocast: bool = False) -> tuple[list[float], dict]:
    model = make_model()
    losses, _ = train(model, *global_batch(), autocast=autocast)
    return losses, model.state_dict()


def assert_state_close(actual: dict, expected: dict, rtol: float, atol: float) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=rtol, atol=atol, msg=key)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_two_ranks_match_single_process_eager(two_ranks, zero: int) -> None:
    ref_losses, ref_state = reference()
    rank_losses = torch.tensor([r[f"zero{zero}"]["losses"] for r in two_ranks])
    torch.testing.assert_close(
        rank_losses.mean(0), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
    )
    assert two_ranks[1][f"zero{zero}"]["full"] == {}
    assert_state_close(two_ranks[0][f"zero{zero}"]["full"], ref_state, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_state_dict_keeps_original_names(two_ranks) -> None:
    assert two_ranks[0]["keys"] == list(make_model().state_dict().keys())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_parameters_are_dtensor_shards_of_the_original_shapes(two_ranks, zero: int) -> None:
    shapes = [tuple(p.shape) for p in make_model().parameters()]
    for result in two_ranks:
        assert result[f"zero{zero}"]["shapes"] == shapes
        expected = {("Parameter", "")} if zero == 0 else {("DTensor", str((Shard(0),)))}
        assert set(result[f"zero{zero}"]["kinds"]) == expected


@pytest.mark.timeout(240)
def test_full_state_dict_load_round_trip(two_ranks) -> None:
    assert all(r["roundtrip_shards_equal"] for r in two_ranks)
    assert_state_close(
        two_ranks[0]["everywhere_full"], make_model(seed=3).state_dict(), rtol=0, atol=0
    )


@pytest.mark.timeout(240)
def test_meta_init_equals_normal_init(two_ranks) -> None:
    assert_state_close(two_ranks[0]["meta_full"], make_model().state_dict(), rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_bf16_within_bf16_tolerance_of_autocast(two_ranks) -> None:
    model = make_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(*global_batch())
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            two_ranks[0]["bf16_grads"][name].float(), param.grad, rtol=2e-2, atol=1e-2, msg=name
        )
    ref_losses, ref_state = reference(autocast=True)
    rank_losses = torch.tensor([r["bf16_losses"] for r in two_ranks])
    torch.testing.assert_close(rank_losses.mean(0), torch.tensor(ref_losses), rtol=5e-3, atol=0)
    full = two_ranks[0]["bf16_full"]
    assert all(v.dtype == torch.float32 for v in full.values())
    # Adam's first steps move a weight by about +-lr whatever its gradient's size, so a tiny
    # gradient whose sign differs between bf16 paths costs up to 2 * lr per step: compare
    # trained weights (order 1) to within STEPS * lr.
    assert_state_close(full, ref_state, rtol=0, atol=STEPS * 1e-2)


@pytest.mark.timeout(240)
def test_zero3_state_bytes_are_a_dp_fraction(two_ranks) -> None:
    model = make_model()
    _, optimizer = train(model, *global_batch())
    full_bytes = state_bytes(model, optimizer)
    padding_bytes = (two_ranks[0]["padded"] - sum(p.numel() for p in model.parameters())) * 4
    # Uneven rows: rank 0 may own a row more than rank 1 (its optimizer state is larger);
    # flat buffers are padded to the same size on both.
    total = sum(result["bytes"] for result in two_ranks)
    assert full_bytes <= total <= full_bytes + 3 * padding_bytes
    for result in two_ranks:
        assert result["bytes"] <= full_bytes / 2 + 3 * padding_bytes / 2


@pytest.mark.timeout(240)
def test_pp_must_divide_world(two_ranks) -> None:
    assert "pp=3" in two_ranks[0]["pp3_error"] and "world size 2" in two_ranks[0]["pp3_error"]


class _Plain(nn.Module):
    """A parameter directly on a module without reset_parameters (meta init must refuse it)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


class _WithMetaBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("mask", torch.ones(2))


def _parametrized() -> nn.Module:
    model = nn.Linear(2, 2)
    torch.nn.utils.parametrize.register_parametrization(model, "weight", nn.Identity())
    return model


def _meta(factory):
    with torch.device("meta"):
        return factory()


@pytest.mark.parametrize(
    "build, kwargs, message",
    [
        (lambda: parallelize(make_model()), {}, "already parallelized"),
        (make_model, {"zero": 4}, r"zero=4 is not allowed: zero must be one of 0, 1, 2, 3"),
        (make_model, {"zero": True}, r"zero=True is not allowed"),
        (make_model, {"pp": 0}, r"pp=0 is not allowed: pp must be an integer >= 1"),
        (make_model, {"pp": 2}, r"pp=2 is not allowed: pp must divide the world size 1"),
        (make_model, {"mixed_precision": "fp16"}, r"mixed_precision='fp16' is not allowed"),
        (lambda: [1, 2], {}, r"model=list is not allowed"),
        (_parametrized, {}, r"module '<root>' already has parametrizations"),
        (lambda: _meta(_Plain), {}, r"parameter 'scale' is on the meta device"),
        (lambda: _meta(_WithMetaBuffer), {}, r"buffer 'mask' is on the meta device"),
    ],
)
def test_invalid_arguments_raise_value_errors(build, kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parallelize(build(), **kwargs)


def test_layout_and_parameter_names_single_rank() -> None:
    model = parallelize(make_model(), zero=3)
    layout = model._zeroc_layout
    assert (layout.zero, layout.pp, layout.dp, layout.world) == (3, 1, 1, 1)
    assert (layout.mesh.rank, layout.dp_group_name, layout.mesh.pp_group_name) == (0, "", "")
    names = [name for name, _ in model.named_parameters()]
    assert names == [name for name, _ in make_model().named_parameters()]
    tok = layout.by_name()["head.weight"]
    assert (tok.name, tok.tied_names, tok.shape) == ("tok.weight", ("head.weight",), (13, 6))
    flat = model.tok.__dict__["_zeroc_flat_weight"]
    assert flat is model.head.__dict__["_zeroc_flat_weight"]
    assert flat._zeroc_layout is layout and flat._zeroc_param is tok
    # Without a process group the visible parameter is a plain view of the flat buffer.
    assert model.tok.weight is model.head.weight and model.tok.weight.shape == (13, 6)
    assert model.tok.weight.data_ptr() == flat.data_ptr()
    plain = parallelize(make_model(), zero=0)
    assert plain.tok.__dict__["_zeroc_flat_weight"].shape == (13 * 6,)
    assert list(plain.state_dict()) == list(make_model().state_dict())


@pytest.mark.parametrize("zero", [0, 3])
def test_single_rank_without_process_group_matches_eager(zero: int) -> None:
    ref_losses, ref_state = reference()
    model = parallelize(make_model(), zero=zero)
    losses, _ = train(model, *global_batch())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert_state_close(full_state_dict(model), ref_state, rtol=1e-5, atol=1e-6)
    model.load_state_dict(model.state_dict())
    restored = parallelize(make_model(seed=5), zero=zero)
    load_full_state_dict(restored, full_state_dict(model))
    assert_state_close(full_state_dict(restored), ref_state, rtol=1e-5, atol=1e-6)


def four_rank_checks(rank: int, world: int) -> dict:
    """ZeRO-3 over 4 ranks (padding in every shard) and ZeRO-2 on a pp=2 x dp=2 mesh."""
    from zeroc.runtime.mesh import build_mesh

    out: dict = {}
    model = parallelize(make_model(), zero=3)
    out["zero3_losses"], _ = train(model, *local_batch(rank, 4))
    out["zero3_full"] = full_state_dict(model)
    mesh = build_mesh(2)
    out["mesh"] = (mesh.pp_index, mesh.dp_index, mesh.dp_group_ranks, mesh.pp_group_ranks)
    mixed = parallelize(make_model(), zero=2, pp=2)
    out["pp2_losses"], _ = train(mixed, *local_batch(mesh.dp_index, 2))
    out["pp2_full"] = full_state_dict(mixed)
    return out


@pytest.mark.timeout(240)
def test_four_ranks_zero3_and_pp2_mesh() -> None:
    results = run_ranks(four_rank_checks, 4, timeout=200)
    ref_losses, ref_state = reference()
    assert [r["mesh"] for r in results] == [
        (0, 0, (0, 1), (0, 2)),
        (0, 1, (0, 1), (1, 3)),
        (1, 0, (2, 3), (0, 2)),
        (1, 1, (2, 3), (1, 3)),
    ]
    zero3 = torch.tensor([r["zero3_losses"] for r in results]).mean(0)
    torch.testing.assert_close(zero3, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert_state_close(results[0]["zero3_full"], ref_state, rtol=1e-5, atol=1e-6)
    for pp_index in (0, 1):
        pair = torch.tensor([r["pp2_losses"] for r in results[2 * pp_index : 2 * pp_index + 2]])
        torch.testing.assert_close(pair.mean(0), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert_state_close(results[0]["pp2_full"], ref_state, rtol=1e-5, atol=1e-6)


def test_rejected_model_is_left_untouched() -> None:
    model = _meta(_WithMetaBuffer)
    with pytest.raises(ValueError):
        parallelize(model)
    assert not torch.nn.utils.parametrize.is_parametrized(model.fc)
    assert not hasattr(model, "_zeroc_layout")


def test_a_deleted_model_is_freed_with_its_shards() -> None:
    """A parallelized model, after a backward and an accumulation, is freed when the user drops
    it: nothing zeroc registers (gradient hooks on its flat buffers and sinks) keeps it."""
    import gc
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    parallelize(model, zero=3)
    state = model.__dict__["_zeroc_state"]
    alive = [weakref.ref(state), *(weakref.ref(s.flat) for s in state.params)]
    model.set_requires_gradient_sync(False)
    model(torch.randn(3, 4)).sum().backward()
    model.set_requires_gradient_sync(True)
    model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    del model, state
    gc.collect()
    assert not any(ref() is not None for ref in alive)
