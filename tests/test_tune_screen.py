"""The tuner's screen of a world that is not here: the profiled step, its agreement with full
plans, and ``zeroc.tune(world=64)`` on a Llama-7B-shaped model.

The screen (``zeroc.tuning.tune_screen``) models each candidate from one fake training step of the
plain model (``zeroc.world.model_profile``); the tuner plans only the screen's best in full. These
tests check the profile against torch's own counts, the screen's model state and ranking
against full plans of the same candidates, and the whole search at world 64. The tiny GPT's
checks use one block (``_tiny``): the figures they compare do not depend on how many.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from models.gpt import GPT, GPTConfig
from torch.utils.flop_counter import FlopCounterMode

import zeroc
import zeroc.tuning.tune_world as tune_world
from zeroc.runtime.cost.hardware import get_profile
from zeroc.runtime.errors import OptionError
from zeroc.tuning.tune_result import spearman
from zeroc.tuning.tune_screen import screen, state_bytes
from zeroc.tuning.tune_space import Candidate, candidates
from zeroc.world.model_profile import profile_model
from zeroc.world.world_plan import plan_world

transformers = pytest.importorskip("transformers")


def _llama(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int,
           seq: int, meta: bool = True) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
        use_cache=False, tie_word_embeddings=False)
    if not meta:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _tiny() -> GPT:
    """The tiny GPT with one block (Dynamo's trace, and so each plan, grows with the blocks)."""
    return GPT(dataclasses.replace(GPTConfig.tiny(), n_layer=1), seed=0)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))


@functools.cache
def _zero3_peak(offload: str | None) -> int:
    """The largest planned peak of ``_tiny`` at world 4, ZeRO-3 on cuda (planned once for the
    two tests that size a device from it)."""
    tokens = _tokens()
    return max(m.peak for m in plan_world(_tiny(), (tokens, tokens), world=4, zero=3,
                                          device="cuda", offload=offload).memory)


class NoLoss(torch.nn.Module):
    """Returns a tuple, no loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x), x


def test_profile_counts_the_step_and_leaves_the_model_alone() -> None:
    model = GPT(GPTConfig.tiny(), seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    profile = profile_model(model, (tokens, tokens))
    for name, param in model.named_parameters():  # a meta copy was profiled
        assert param.device.type == "cpu" and param.grad is None
        assert torch.equal(param, before[name]), name
    distinct = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}
    assert profile.param_bytes == sum(distinct.values())
    assert sum(op.param_bytes for op in profile.forward) == profile.param_bytes
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens)
    matmul = counter.get_total_flops()
    forward = sum(op.flops for op in profile.forward)
    backward = sum(op.flops for op in profile.backward)
    assert matmul <= forward < 2 * matmul  # matmuls, and one FLOP per element elsewhere
    assert 1.5 * forward < backward < 2.5 * forward  # input and weight gradients
    saved = sum(op.saved for op in profile.forward)
    assert 0 < saved < sum(op.out_bytes for op in profile.forward)
    assert profile.rows == 4


def test_profile_refuses_a_model_without_a_loss() -> None:
    with pytest.raises(ValueError, match="returned tuple; a training step needs a scalar"):
        profile_model(NoLoss(), (torch.randn(2, 4),))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_screened_model_state_is_the_planned_one(zero: int) -> None:
    """Without a pipeline the screen's parameters, gradients and AdamW state per rank are
    exactly what a full plan measures on its fake tensors (zeroc pads no flat here)."""
    model = _tiny()
    tokens = _tokens()
    profile = profile_model(model, (tokens, tokens))
    candidate = Candidate(zero, 1, (("fused_loss", True), ("partitioner", "default")))
    screened = screen(profile, candidate, 4, get_profile("h100-sxm"))
    plan = plan_world(model, (tokens, tokens), world=4, pp=1, zero=zero, device="cpu")
    row = plan.memory[0]
    assert screened.state_bytes == row.params + row.grads + row.optimizer
    assert screened.state_bytes == state_bytes(profile.param_bytes, zero, 4)


@pytest.mark.slow
def test_screen_ranks_layouts_as_their_plans_do() -> None:
    """Over pipelines of a small Hugging Face Llama at world 8, the screen orders step time
    and peak memory as full plans do, and its peaks are within 40% of the planned ones. Four
    layouts: pp 2 and 4, 1F1B and DualPipeV, 2 to 8 micro-batches (each plan costs seconds)."""
    model = _llama(layers=4, hidden=256, ffn=704, heads=4, kv_heads=4, vocab=2000, seq=128)
    tokens = torch.zeros(8, 128, dtype=torch.long)
    inputs = {"input_ids": tokens, "labels": tokens}
    hardware = get_profile("h100-sxm")
    profile = profile_model(model, inputs, "cuda")  # the device the plans are for
    layouts = [(2, "1f1b", 2), (2, "1f1b", 8), (2, "dualpipev", 4), (4, "1f1b", 8)]
    screened, planned = [], []
    for pp, schedule, microbatches in layouts:
        candidate = Candidate(3, pp, tuple(sorted({
            "schedule": schedule, "microbatches": microbatches, "fused_loss": True,
            "partitioner": "default", "bucket_mb": 25.0}.items())))
        screened.append(screen(profile, candidate, 8, hardware))
        plan = plan_world(model, inputs, world=8, pp=pp, zero=3, device="cuda",
                          hardware=hardware, options=candidate.options_dict())
        planned.append((plan.estimate.step_s, max(m.peak for m in plan.memory)))
    steps = spearman([s.step_s for s in screened], [p[0] for p in planned])
    peaks = spearman([s.peak_bytes for s in screened], [p[1] for p in planned])
    assert steps >= 0.7, (steps, screened, planned)
    assert peaks >= 0.7, (peaks, screened, planned)
    for found, (_, peak) in zip(screened, planned, strict=True):
        assert 0.6 < found.peak_bytes / peak < 1.4, (found, peak)


@pytest.mark.slow
def test_tune_ranks_a_7b_layout_for_world_64_without_the_cluster(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``zeroc.tune(world=64, device="cuda", hardware="h100-sxm")`` on a Llama-7B-shaped model
    on the meta device, at a batch of 8 x 4096 tokens: every candidate screened, the best
    planned in full, the winner the best planned one that fits, its screened peak within 10%
    of its planned one, and why it wins. Attention plans as a GPU runs it (a fused kernel that
    keeps no score matrix: ``tests/test_planned_attention.py``); planned as the CPU's math
    kernel, no layout fits. The screen's check reuses the tuner's own profile of the model."""
    profiles = []

    def profiled(*args, **kwargs):
        profiles.append(profile_model(*args, **kwargs))
        return profiles[-1]

    monkeypatch.setattr(tune_world, "profile_model", profiled)
    model = _llama(layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000,
                   seq=4096)
    tokens = torch.zeros(8, 4096, dtype=torch.long)
    inputs = {"input_ids": tokens, "labels": tokens}
    result = zeroc.tune(model, inputs, world=64, device="cuda", hardware="h100-sxm",
                        cache_dir=str(tmp_path))
    assert not result.measured and not result.from_cache
    assert len(result.trials) == len(candidates(64, 8, hardware=get_profile("h100-sxm")))
    assert all(t.measured_s is None for t in result.trials)
    assert all(t.screened_s is not None or t.rejected for t in result.trials)
    planned = [t for t in result.trials if t.estimated_s is not None]
    assert 1 <= len(planned) <= 3
    capacity = get_profile("h100-sxm").memory_bytes
    fitting = [t for t in planned if not t.rejected]
    best = min(fitting, key=lambda t: t.estimated_s)
    assert result.best == best.candidate and best.peak_bytes <= capacity
    assert best.candidate.pp > 1  # one GPU cannot hold a 7B step of 8 x 4096 tokens
    (profile,) = profiles  # profile_model(model, inputs, "cuda"), as the tuner made it
    assert profile.rows == 8
    screened = screen(profile, best.candidate, 64, get_profile("h100-sxm")).peak_bytes
    assert 0.9 < screened / best.peak_bytes < 1.1, (best.candidate.label(), screened,
                                                    best.peak_bytes)
    assert any(t.rejected.startswith("needs") for t in result.trials)
    why = result.why()
    for words in ("fit in memory", "bubble", "exposed communication", "next best"):
        assert words in why, why
    assert "screened step (ms)" in result.table()


def test_tune_world_names_a_model_it_cannot_profile(tmp_path) -> None:
    with pytest.raises(OptionError, match="cannot profile the model's training step"):
        zeroc.tune(NoLoss(), (torch.randn(8, 4),), world=16, hardware="h100-sxm",
                   device="cuda", cache_dir=str(tmp_path))


def test_planning_stops_when_no_planned_candidate_fits(tmp_path) -> None:
    """A device the screen thinks large enough but the plans do not: planning stops after
    ``measure_best`` once the budget is spent, and the error names the smallest planned
    peak."""
    model = _tiny()
    tokens = _tokens()
    search = {"pp": [1], "zero": [3], "fused_loss": [True], "partitioner": ["min_cut",
                                                                            "default"],
              "prefetch": [1]}
    profile = profile_model(model, (tokens, tokens), "cuda")
    screened = max(screen(profile, c, 4, get_profile("h100-sxm")).peak_bytes
                   for c in candidates(4, 4, search))
    planned = _zero3_peak(None)
    assert screened < planned  # the tiny model's plan holds more than the screen counts
    small = {**get_profile("h100-sxm").to_dict(), "name": "small",
             "memory_bytes": (screened + planned) // 2}
    with pytest.raises(OptionError, match=r"none of the screened candidates could be planned "
                                          r"to fit on cuda for world=4: the smallest planned "
                                          r"peak is"):
        zeroc.tune(model, (tokens, tokens), world=4, search=search, hardware=small,
                   device="cuda", budget_s=0.001, measure_best=1, cache_dir=str(tmp_path))


def test_a_slow_link_makes_quantized_collectives_candidates_the_screen_prefers() -> None:
    """On a profile whose inter-node link is slow (10 Gbit/s), a 16-rank data-parallel job
    spanning two nodes gets quantized candidates (int8 gathers, int4 reductions) when lossy
    options are allowed, the screen
    ranks them faster than the exact layout, the table names them, and ``search`` forbids
    them; on the stock profile (400 Gbit/s) they are not default candidates. hpZ with one
    node's 8 devices is a candidate on both (the ranks span nodes), and the screen ranks it
    faster still: the backward's gathers stay inside the node."""
    from zeroc.tuning.tune_result import Trial, TuneResult
    from zeroc.tuning.tune_space import slow_link

    def key(c: Candidate) -> tuple:
        o = c.options_dict()
        return o.get("gather_quant"), o.get("reduce_quant"), o.get("secondary_shard")

    fast = get_profile("h100-sxm")
    slow = get_profile({**fast.to_dict(), "name": "slow", "inter_node_bytes_per_s": 1.25e9})
    assert slow_link(16, 1, slow) and not slow_link(16, 1, fast) and not slow_link(8, 1, slow)
    search = {"pp": [1], "zero": [3], "fused_loss": [True], "partitioner": ["min_cut"],
              "prefetch": [1]}
    assert [key(c) for c in candidates(16, 16, search, fast)] == [(None, None, None),
                                                                  (None, None, 8)]
    assert [key(c) for c in candidates(8, 16, search, fast)] == [(None, None, None)]
    # Lossy options only when allowed: the slow link alone does not make them candidates.
    assert [key(c) for c in candidates(16, 16, search, slow)] == [(None, None, None),
                                                                  (None, None, 8)]
    space = candidates(16, 16, search, slow, lossy=True)
    assert {key(c) for c in space} == {(g, r, k) for g in (None, "int8") for r in (None, "int4")
                                       for k in (None, 8)}
    assert key(space[0]) == (None, None, None)  # exact first
    forbidden = candidates(16, 16, {**search, "gather_quant": [None], "reduce_quant": [None],
                                    "secondary_shard": [None]}, slow, lossy=True)
    assert [key(c) for c in forbidden] == [(None, None, None)]
    model = _llama(layers=4, hidden=512, ffn=1376, heads=8, kv_heads=8, vocab=8000, seq=256)
    tokens = torch.zeros(16, 256, dtype=torch.long)
    profile = profile_model(model, {"input_ids": tokens, "labels": tokens}, "cuda")
    steps = {c: screen(profile, c, 16, slow).step_s for c in space}
    both = next(c for c in space if key(c) == ("int8", "int4", None))
    assert steps[both] < 0.8 * steps[space[0]]
    assert min(steps, key=steps.get) == next(c for c in space if key(c) == ("int8", "int4", 8))
    assert steps[next(c for c in space if key(c) == (None, None, 8))] < steps[space[0]]
    table = TuneResult(both, tuple(Trial(c, estimated_s=s) for c, s in steps.items()),
                       False, "").table()
    assert "gather_quant=int8" in table and "reduce_quant=int4" in table
    assert "secondary_shard=8" in table


@pytest.mark.timeout(600)
def test_a_model_that_fits_only_with_offload_gets_offload(tmp_path) -> None:
    """A device between the planned peaks of ZeRO-3 with and without optimizer offload: the
    tuner's exact layouts do not fit, so it ranks them again offloading the optimizer and
    picks one, instead of raising; its table lists both."""
    model = _tiny()
    tokens = _tokens()
    search = {"pp": [1], "zero": [3], "fused_loss": [True], "partitioner": ["min_cut"],
              "prefetch": [1]}
    peaks = {offload: _zero3_peak(offload) for offload in (None, "optimizer")}
    assert peaks["optimizer"] < peaks[None]
    small = {**get_profile("h100-sxm").to_dict(), "name": "small",
             "memory_bytes": (peaks[None] + peaks["optimizer"]) // 2}
    result = zeroc.tune(model, (tokens, tokens), world=4, search=search, hardware=small,
                        device="cuda", budget_s=60, measure_best=1, cache_dir=str(tmp_path))
    assert result.best.offload == "optimizer" and result.best.zero == 3
    assert {t.candidate.offload for t in result.trials} == {None, "optimizer"}
    assert "offload=optimizer" in result.table()
    assert Candidate.from_json(result.best.to_json()) == result.best


def test_the_summary_counts_estimated_over_budget_and_skipped_candidates_apart() -> None:
    """``why()`` never counts a candidate that was not estimated as one that does not fit."""
    from zeroc.tuning.tune_result import Trial, TuneResult

    space = candidates(16, 16, {"pp": [1], "zero": [3, 2, 0], "prefetch": [1]})
    assert len(space) >= 3
    trials = (Trial(space[0], estimated_s=0.1, peak_bytes=1 << 30),
              Trial(space[1], estimated_s=0.2, peak_bytes=1 << 40, rejected="needs 1 TiB > 80 GiB"),
              *(Trial(c, rejected="not estimated: budget spent") for c in space[2:]))
    text = TuneResult(space[0], trials, False, "").why()
    assert (f"of {len(space)} candidates 2 estimated: 1 fit in memory, 1 over it; "
            f"{len(space) - 2} not estimated") in text, text
