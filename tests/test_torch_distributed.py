"""zeroc parameters with the rest of torch.distributed: DCP, clip_grad_norm_, accumulation,
frozen parameters and mixed-precision policies, on gloo ranks against single-process eager.

The zoo GPT trains through ``torch.compile(..., backend="zeroc")``. A 2-rank job saves a DCP
checkpoint after two ZeRO-3 steps; a 4-rank job (a fresh process group, dp=4) loads it into
ZeRO-3 and ZeRO-1 models (ZeRO-1 by ``set_model_state_dict`` and by DCP's in-place load alone:
either must reach the whole parameters every rank keeps), a plain single-process model loads
it too, and all train on; each must equal an uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig
from parity import ADAM, assert_tensors_match
from torch import nn

import zeroc

GLOBAL_BATCH = 8
STEPS = 4  # the DCP test: 2 steps, save, 2 more
MAX_NORM = 0.05  # below the GPT's gradient norm, so clipping changes every update


def make_gpt() -> GPT:
    return GPT(GPTConfig.tiny(), seed=5)


def batches(steps: int = STEPS, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = GPTConfig.tiny()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (steps, GLOBAL_BATCH, cfg.block_size + 1),
                           generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def rows(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int):
    per = GLOBAL_BATCH // world
    return tuple(t[rank * per:(rank + 1) * per] for t in batch)


def eager_run(steps: range, model: nn.Module | None = None, clip: float | None = None,
              optimizer: torch.optim.Optimizer | None = None):
    """Single-process eager training on the global batches ``steps``."""
    model = model or make_gpt()
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), **ADAM)
    losses, norms = [], []
    for index in steps:
        loss = model(*batches()[index])
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, model


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train_ranks(model: nn.Module, optimizer, steps: range, rank: int, world: int,
                clip: float | None = None):
    compiled = torch.compile(model, backend="zeroc")
    losses, norms = [], []
    for index in steps:
        loss = compiled(*rows(batches()[index], rank, world))
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean_over_ranks(loss))
    return losses, norms


def save_job(rank: int, world: int, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = zeroc.parallelize(make_gpt(), zero=3)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    losses, _ = train_ranks(model, optimizer, range(2), rank, world)
    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=directory)
    kinds = {type(v).__name__ for v in model.state_dict().values()}
    return {"losses": losses, "kinds": kinds, "saved": full_training_state(model, optimizer)}


def full_training_state(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and Adam moment as a full tensor, keyed by name (collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def full(value):
        return value.full_tensor() if hasattr(value, "full_tensor") else value.clone()

    out = {f"param/{k}": full(v) for k, v in model.state_dict().items()}
    for name, moments in get_optimizer_state_dict(model, optimizer)["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = full(moments[key])
    return out


def _load(model: nn.Module, optimizer, directory: str, in_place: bool = False) -> None:
    """Load a DCP checkpoint; ``in_place``: the model's values only by ``dcp.load`` writing
    into ``get_model_state_dict``'s tensors (no ``set_model_state_dict``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=directory)
    if not in_place:
        set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])


RESUMED = {"zero3": (3, False), "zero1": (1, False), "zero1_in_place": (1, True)}


def resume_job(rank: int, world: int, directory: str) -> dict:
    out = {}
    for name, (zero, in_place) in RESUMED.items():
        model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=99), zero=zero)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
        _load(model, optimizer, directory, in_place=in_place)
        loaded = full_training_state(model, optimizer)
        losses, _ = train_ranks(model, optimizer, range(2, 4), rank, world)
        out[name] = {"losses": losses, "full": zeroc.full_state_dict(model), "loaded": loaded}
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dcp_checkpoint_reshards_from_dp2_to_dp4_and_to_a_plain_model(tmp_path) -> None:
    directory = str(tmp_path / "ckpt")
    saved = run_ranks(save_job, 2, directory, timeout=300)
    assert saved[0]["kinds"] == {"DTensor"}
    resumed = run_ranks(resume_job, 4, directory, timeout=300)[0]
    plain = GPT(GPTConfig.tiny(), seed=99)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), **ADAM)
    _load(plain, plain_optimizer, directory)
    # What was saved at dp=2 is loaded exactly, resharded to dp=4 and into the plain model.
    loads = [run["loaded"] for run in resumed.values()]
    for loaded in (*loads, full_training_state(plain, plain_optimizer)):
        assert loaded.keys() == saved[0]["saved"].keys()
        for key, value in saved[0]["saved"].items():
            assert torch.equal(loaded[key], value), key
    plain_losses, _, plain = eager_run(range(2, 4), plain, optimizer=plain_optimizer)
    ref_losses, _, ref = eager_run(range(4))
    for name, run in resumed.items():
        torch.testing.assert_close(torch.tensor(saved[0]["losses"] + run["losses"]),
                                   torch.tensor(ref_losses), rtol=1e-6, atol=0, msg=name)
    torch.testing.assert_close(torch.tensor(plain_losses), torch.tensor(ref_losses[2:]),
                               rtol=1e-6, atol=0)
    # Training on equals the uninterrupted run up to the reduction order of dp=4 (fp32 parity).
    for name, run in resumed.items():
        assert_tensors_match(ref.state_dict(), run["full"], f"resumed at dp=4, {name}")
    assert_tensors_match(ref.state_dict(), plain.state_dict(), "resumed in a plain model")


def clip_and_accumulate_job(rank: int, world: int) -> dict:
    out: dict = {}
    for zero in (0, 1, 2, 3):
        torch._dynamo.reset()
        model = zeroc.parallelize(make_gpt(), zero=zero)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
        losses, norms = train_ranks(model, optimizer, range(2), rank, world, clip=MAX_NORM)
        out[zero] = {"losses": losses, "norms": norms, "full": zeroc.full_state_dict(model)}
    out["accumulate"] = accumulate(rank, world)
    return out


def _count_reductions(fn) -> tuple[int, int]:
    """Gradient reductions ``fn`` runs: (reduce-scatter / all-reduce nodes in the graphs it
    executes, bucketed reductions of accumulated sums when a backward ends)."""
    from zeroc.runtime.executor import GraphExecutor
    from zeroc.sharding import accumulation

    functional = torch.ops._c10d_functional
    kinds = {functional.reduce_scatter_tensor.default, functional.all_reduce.default,
             functional.all_to_all_single.default}  # gloo: zeroc's reduce-scatter
    run, reduce_bucket = GraphExecutor.__call__, accumulation._reduce_bucket
    count = [0, 0]

    def counting(self, args):
        count[0] += sum(1 for n in self.gm.graph.nodes if n.target in kinds)
        return run(self, args)

    def counting_buckets(bucket):
        count[1] += 1
        return reduce_bucket(bucket)

    GraphExecutor.__call__ = counting
    accumulation._reduce_bucket = counting_buckets
    try:
        fn()
    finally:
        GraphExecutor.__call__ = run
        accumulation._reduce_bucket = reduce_bucket
    return count[0], count[1]


def accumulate(rank: int, world: int, micro_steps: int = 3) -> dict:
    """k micro-steps without sync, then one with: counts and the gradients."""
    torch._dynamo.reset()
    model = zeroc.parallelize(make_gpt(), zero=3)
    compiled = torch.compile(model, backend="zeroc")
    counts = []
    micro = batches(micro_steps + 1, seed=11)
    for index, batch in enumerate(micro):
        last = index == micro_steps
        model.set_requires_gradient_sync(last)
        counts.append(_count_reductions(lambda b=batch: compiled(*rows(b, rank, world))
                                        .backward()))
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    with zeroc.no_sync(model):
        assert not zeroc.sharding.sharded_params.state_of(model).requires_gradient_sync
    plan = zeroc.explain(compiled)
    # Compiled: only the no-sync graphs (the step that ends the accumulation runs them too).
    reductions = sum(1 for c in plan.collectives if c.op in ("reduce_scatter", "all_reduce"))
    return {"counts": counts, "grads": grads, "reductions": reductions}


@pytest.fixture(scope="module")
def clipped() -> list[dict]:
    return run_ranks(clip_and_accumulate_job, 2, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(700)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_clip_grad_norm_returns_the_global_norm_and_clips_alike(clipped, zero: int) -> None:
    ref_losses, ref_norms, ref = eager_run(range(2), clip=MAX_NORM)
    for result in clipped:
        torch.testing.assert_close(torch.tensor(result[zero]["norms"]), torch.tensor(ref_norms),
                                   rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(clipped[0][zero]["losses"]),
                               torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(clipped[0][zero]["full"][key], value, rtol=1e-5, atol=1e-6,
                                   msg=key)


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_gradient_accumulation_reduces_once(clipped) -> None:
    result = clipped[0]["accumulate"]
    # No reduction while accumulating; the last step reduces the sums of the whole tiny
    # model once, in one bucket, when its backward ends; no graph is compiled for it.
    assert result["counts"] == [(0, 0), (0, 0), (0, 0), (0, 1)]
    assert result["reductions"] == 0
    model = make_gpt()
    for batch in batches(4, seed=11):
        model(*batch).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(result["grads"][name], param.grad, rtol=1e-5,
                                   atol=1e-5 * param.grad.abs().max().item(), msg=name)


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update (LoRA)."""

    def __init__(self, width: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class LoRAModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.blocks = nn.Sequential(LoRALinear(8), nn.GELU(), LoRALinear(8))
        self.head = nn.Linear(8, 5)
        nn.init.normal_(self.blocks[0].up.weight, std=0.1)
        nn.init.normal_(self.blocks[2].up.weight, std=0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.blocks(x)), y)


def lora_data():
    generator = torch.Generator().manual_seed(2)
    return torch.randn(3, 8, 8, generator=generator), torch.randint(0, 5, (3, 8),
                                                                    generator=generator)


def lora_job(rank: int, world: int) -> dict:
    model = zeroc.parallelize(LoRAModel(), zero=3)
    compiled = torch.compile(model, backend="zeroc")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAM)
    xs, ys = lora_data()
    per = 8 // world
    losses = []
    for x, y in zip(xs, ys, strict=True):
        loss = compiled(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        frozen_grads = [p.grad for p in model.parameters() if not p.requires_grad]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean_over_ranks(loss))
    plan = zeroc.explain(compiled)
    reduced = {p for c in plan.collectives if c.op == "reduce_scatter" for p in c.params}
    gathered = {p for c in plan.collectives if c.op == "all_gather" for p in c.params}
    return {"losses": losses, "full": zeroc.full_state_dict(model), "reduced": reduced,
            "gathered": gathered, "frozen_grads": frozen_grads,
            "state": len(optimizer.state)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_frozen_parameters_are_gathered_but_never_reduced() -> None:
    results = run_ranks(lora_job, 2, timeout=240)
    model = LoRAModel()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAM)
    losses = []
    for x, y in zip(*lora_data(), strict=True):
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(losses),
                               rtol=1e-5, atol=0)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(results[0]["full"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and frozen <= results[0]["gathered"]
    assert not frozen & results[0]["reduced"]
    assert results[0]["frozen_grads"] == [None] * len(frozen)
    assert results[0]["state"] == sum(p.requires_grad for p in model.parameters())
