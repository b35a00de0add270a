"""Pipelined training on gloo ranks against single-process eager on the global batch.

One multi-rank job per world layout trains its (model, schedule) cases for two AdamW steps
with ``zeroc.parallelize(model, zero, pp)`` and ``torch.compile(backend="zeroc",
options={"schedule": ...})`` and returns the losses and ``zeroc.full_state_dict``. Each must
match eager within fp32 tolerance (see ``parity.assert_tensors_match``), every rank must have
fused the head and loss, and no backward graph may recompute attention. Every schedule but
1F1B trains the zoo GPT at pp=4 (one block per stage: the GPT's blocks trace in about half
the Llama's ops, and 4 ranks on the suite's two cores are its slowest cases); at pp=2, 1F1B
trains the zoo Llama (its rotary buffers read on both stages) and DualPipe (whose last stages
sit on both positions) the GPT, and DualPipeV trains the GPT in the pp=2 x dp=2 ZeRO-3 job,
which also checks ``torch.no_grad()`` forwards, ``(0.5 * loss).backward()``, the plan's grid
and the Chrome trace.

Not run here: GPipe and ZB1P at pp=2 (they equal eager at pp=2 on BART in
``tests/test_encoder_decoder_pipeline.py`` and train here at pp=4); DualPipeV at pp=2
without data parallelism (the pp=2 x dp=2 job trains the same GPT under it, with the same
checks); 1F1B at pp=4 (it trains to eager's numbers in ``tests/test_stage_memory.py``, on the
zoo GPT, and in ``tests/test_hf_pipeline.py`` and ``tests/test_encoder_decoder_pipeline.py``,
on Hugging Face models); the zoo Llama at pp=4 (what it adds to the GPT, blocks that read
rotary buffers no stage passes them, runs at pp=2, where both stages read them).
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from parity import ADAM, assert_gradients_match, assert_tensors_match, gradients

STEPS, BATCH = 2, 8


def make(kind: str, layers: int) -> torch.nn.Module:
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, d_model=32))
    return Llama(LlamaConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, d_model=32,
                             ffn_hidden=64))


def eager_reference(kind: str, layers: int):
    model = make(kind, layers)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    x, y = model.example_batch(BATCH)
    losses = []
    for _ in range(STEPS):
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        final = model(x, y).item()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, final


def train_cases(rank: int, world: int, pp: int, zero: int, cases, extras: bool):
    """Rank body: train each (kind, layers, schedule) case; return losses and rank-0 dicts."""
    import zeroc
    from zeroc.sharding.parallelize import parallelize
    from zeroc.sharding.state_dict import full_state_dict

    dp = world // pp
    results = []
    for kind, layers, schedule in cases:
        torch._dynamo.reset()
        model = parallelize(make(kind, layers), zero=zero, pp=pp)
        # The fused loss on, so the last stage runs zeroc::linear_cross_entropy ("auto"
        # leaves heads this small unfused on the CPU).
        compiled = torch.compile(model, backend="zeroc",
                                 options={"schedule": schedule, "fused_loss": True})
        optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
        x, y = model.example_batch(BATCH)
        rows = BATCH // dp
        lo, hi = rank % dp * rows, (rank % dp + 1) * rows
        x, y = x[lo:hi], y[lo:hi]
        losses = []
        for _ in range(STEPS):
            loss = compiled(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out = {"losses": losses, "state": full_state_dict(model),
               "fused_loss": [dict(r.stats) for r in zeroc.explain(compiled).passes
                              if r.pass_name == "fuse_linear_cross_entropy"]}
        # A backward graph that recomputes attention's forward and drops the result is work
        # thrown away (seeded ops that draw nothing must still be dead-code eliminated).
        plan = zeroc.explain(compiled)
        out["attention_in_backward"] = sum(
            plan.graph(g.name).code.count("_scaled_dot_product_flash_attention_for_cpu.default(")
            for g in plan.graphs if not g.name.endswith(".forward"))
        if extras:
            plan = zeroc.explain(compiled)
            out["plan"] = str(plan)
            path = os.path.join(tempfile.mkdtemp(), "trace.json")
            with open(plan.chrome_trace(path)) as handle:
                out["trace"] = json.load(handle)
            with torch.no_grad():
                out["no_grad_loss"] = compiled(x, y).item()
            half = compiled(x, y)
            (0.5 * half).backward()
            out["half_grads"] = gradients(model)
            optimizer.zero_grad()
            compiled(x, y).backward()
            out["full_grads"] = gradients(model)
        results.append(out)
    return results


def check(cases, results, world: int, pp: int) -> None:
    dp = world // pp
    for case_index, (kind, layers, schedule) in enumerate(cases):
        losses, state, _ = eager_reference(kind, layers)
        per_rank = [r[case_index] for r in results]
        for step in range(STEPS):
            # Each data-parallel replica returns its own batch's loss; their mean is global.
            mean = sum(per_rank[d]["losses"][step] for d in range(dp)) / dp
            assert mean == pytest.approx(losses[step], rel=1e-5), (kind, schedule, step)
        for pipeline_rank in range(pp):
            for d in range(dp):
                assert per_rank[pipeline_rank * dp + d]["losses"] == per_rank[d]["losses"]
        assert_tensors_match(state, per_rank[0]["state"], f"{kind} {schedule} parameters")
        # Every rank rewrote the head + loss (the last stage runs zeroc::linear_cross_entropy).
        assert all(r["fused_loss"] == [{"rewritten": "1"}] for r in per_rank), (kind, schedule)
        assert [r["attention_in_backward"] for r in per_rank] == [0] * world, (kind, schedule)


# (model, layers, schedule): one block per stage (DualPipeV runs 2 * pp stages, the others
# pp). The schedule's order is the model's business at neither degree, and a model's cut
# points are the schedule's at neither: the Llama at pp=4 would add nothing but trace time.
CASES_PP2 = [("llama", 2, "1f1b"), ("gpt", 2, "dualpipe")]
CASES_PP4 = [("gpt", 4, "gpipe"), ("gpt", 4, "zb1p"), ("gpt", 4, "dualpipe"),
             ("gpt", 8, "dualpipev")]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_pp2_1f1b_and_dualpipe() -> None:
    results = run_ranks(train_cases, 2, 2, 0, CASES_PP2, False, timeout=1100)
    check(CASES_PP2, results, 2, 2)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pp4_every_schedule() -> None:
    results = run_ranks(train_cases, 4, 4, 0, CASES_PP4, False, timeout=1700)
    check(CASES_PP4, results, 4, 4)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp2_dp2_zero3_dualpipev_plan_and_trace() -> None:
    cases = [("gpt", 4, "dualpipev")]
    results = run_ranks(train_cases, 4, 2, 3, cases, True, timeout=540)
    check(cases, results, 4, 2)
    _, _, final = eager_reference("gpt", 4)
    first = results[0][0]
    mean = sum(results[d][0]["no_grad_loss"] for d in range(2)) / 2
    assert mean == pytest.approx(final, rel=1e-5)
    assert_gradients_match({n: None if g is None else 0.5 * g
                            for n, g in first["full_grads"].items()}, first["half_grads"],
                           "(0.5 * loss).backward()")
    text = first["plan"]
    assert "mesh pp=2 x dp=2, zero 3, schedule dualpipev" in text
    # The grid is drawn with the stage costs measured in the step that ran; the cells' widths
    # (and what lines up beside them) follow those timings, so only the order is checked.
    # A grid wider than the terminal goes on in the next band of lines; a cell cut there
    # ends in ">" and goes on after "<" (its label drawn once or on both sides).
    rows = [line for line in text.splitlines() if line.startswith("rank  0 |")]
    cells = [label for row in rows for cell in row.split("|")[1:]
             if (label := cell.replace(">", "").replace("<", "").strip())]
    labels = [c for i, c in enumerate(cells) if i == 0 or c != cells[i - 1]]
    assert labels[:2] == ["F0", "F1"], rows
    # The overlapped pairs run as F, the forward chunk's sends, then B (pp_reshard=False):
    # the grid and the trace show what ran.
    assert "overlapped pairs run as F, the forward chunk's sends, then B" in text
    assert "&" not in "".join(rows)
    assert "time unit: ms; stage costs measured in the last step" in text
    assert "bubble (measured)" in text and "peak activation memory" in text
    # Each rank's p2p wait of the last step: in the plan's table and in the trace.
    assert "p2p wait (ms, measured)" in text
    waits = first["trace"]["otherData"]["p2p_wait_ms_per_rank"]
    assert len(waits) == 2 and all(w >= 0 for w in waits)
    assert any(e.get("cat") == "p2p wait" for e in first["trace"]["traceEvents"])
    tracks = {e["tid"] for e in first["trace"]["traceEvents"] if e["ph"] == "X"}
    assert tracks == {0, 1}
    names = {e["name"] for e in first["trace"]["traceEvents"] if e["ph"] == "X"}
    assert "F0@s0" in names and not any("&" in n for n in names)
