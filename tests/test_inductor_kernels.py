"""``kernels="inductor"``: Inductor compiles every graph zeroc produces, after zeroc's passes.

- Parity: the zoo but its GPT trains as eager on one process; the zoo GPT (the same model and
  seed) trains as single-process eager on the global batch at ZeRO 0-3 on 2 gloo ranks
  (``test_zero_stages_on_two_ranks_equal_eager``, its case on one process) and at pp=2 with
  DualPipeV (forward, backward, I/W halves and F&B graphs all run through Inductor).
- Collective placement: Inductor's output code issues and waits every ZeRO gather and gradient
  reduction in zeroc's order, with the same matmuls between issue and wait (FileCheck and the
  order read back from the code), and as many of each as the plan lists.
- The plan's kernels table lists Inductor's kernels (from its output code), on a one-block
  GPT (as the no-grad call: each block is more Inductor kernels to compile, C++ on the CPU).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig
from parity import ADAM, assert_tensors_match, train_losses
from test_zero_compiled import check_parity, train_compiled
from test_zoo_parity import ZOO, grads, params
from torch.testing import FileCheck

import zeroc
from zeroc.codegen.inductor_graphs import code_collective_order, inductor_kernels
from zeroc.frontend.session import SESSION_ATTR, wrapper_of

INDUCTOR = {"kernels": "inductor"}
STEPS = 2


def _gpt1() -> GPT:
    """The tiny GPT with one block."""
    torch.manual_seed(0)
    return GPT(dataclasses.replace(GPTConfig.tiny(), n_layer=1))


def _records(compiled: torch.nn.Module) -> list:
    return getattr(wrapper_of(compiled), SESSION_ATTR).records()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name for name in ZOO if name != "gpt"])
def test_zoo_trains_like_eager(name: str) -> None:
    """Two AdamW steps: losses, gradients and parameters equal eager's (fp32 tolerance)."""
    eager = ZOO[name]()
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, backend="zeroc", options=INDUCTOR)
    optimizers = [torch.optim.AdamW(m.parameters(), **ADAM) for m in (eager, module)]
    for step in range(STEPS):
        inputs, targets = eager.example_batch(batch_size=4, seed=100 + step)
        losses = [eager(inputs, targets), compiled(inputs, targets)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        assert_tensors_match(grads(eager), grads(module), f"{name} grad step {step}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        assert_tensors_match(params(eager), params(module), f"{name} param step {step}")
    plan = zeroc.explain(compiled)
    assert plan.kernels and all(k.backend == "inductor" for k in plan.kernels)
    code = {g: c for r in _records(compiled) for g, c in r.output_code.items()}
    # Every kernel of the plan is defined in and launched by the output code of its graph.
    # A plan names each kernel <graph>.<its name in the output code>.
    for kernel in plan.kernels:
        name = kernel.name.removeprefix(f"{kernel.graph}.")
        FileCheck().check(f"{name} = async_compile").check(
            "def call(").check(name).run(code[kernel.graph])


def test_plan_lists_inductor_kernels_from_output_code() -> None:
    model = _gpt1()
    compiled = torch.compile(model, backend="zeroc", options={**INDUCTOR, "fused_loss": False})
    tokens = torch.randint(0, 64, (2, 16))
    compiled(tokens, tokens).backward()
    plan = zeroc.explain(compiled)
    record = _records(compiled)[0]
    assert set(record.output_code) == {"g0.forward", "g0.backward"}
    expected = [f"{graph}.{k.name}" for graph in ("g0.forward", "g0.backward")
                for k in inductor_kernels(record.output_code[graph], graph)]
    assert [k.name for k in plan.kernels] == expected
    assert any("native_layer_norm" in " ".join(k.ops) for k in plan.kernels)
    text = str(plan)
    FileCheck().check(f"kernels ({len(expected)}:").check("inductor").run(text)
    # zeroc's own fusion pass does not run under Inductor.
    assert not any(p.pass_name == "fusion" for p in plan.passes)


def test_no_grad_call_runs_inductors_inference_graph() -> None:
    model = _gpt1()
    compiled = torch.compile(model, backend="zeroc", options=INDUCTOR)
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        got, expected = compiled(tokens, tokens), model(tokens, tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    graphs = {g for r in _records(compiled) for g in r.output_code}
    assert any(g.endswith(".inference") for g in graphs), graphs


@pytest.mark.parametrize("autotune", [False, True])
def test_kernel_autotune_is_inductors_max_autotune(monkeypatch, autotune: bool) -> None:
    """``kernel_autotune`` reaches Inductor as ``max_autotune``; graphs with no collectives
    keep Inductor's own reorderings."""
    import torch._inductor.compile_fx as compile_fx
    from torch._inductor import config as inductor_config

    seen = []
    real = compile_fx.compile_fx_inner

    def spy(gm, inputs, **kwargs):
        seen.append((inductor_config.max_autotune, inductor_config.reorder_for_locality))
        return real(gm, inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", spy)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    compiled = torch.compile(model, backend="zeroc",
                             options={**INDUCTOR, "kernel_autotune": autotune})
    x = torch.randn(4, 8)
    torch.testing.assert_close(compiled(x), model(x))
    assert seen and all(flags == (autotune, True) for flags in seen), seen


def test_unknown_kernels_value_names_inductor() -> None:
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="zeroc", options={"kernels": "cuda"})
    with pytest.raises(ValueError, match="inductor"):
        compiled(torch.randn(2, 4))


def _gpt4() -> GPT:
    return GPT(dataclasses.replace(GPTConfig.tiny(), n_layer=4), seed=5)


def _pipeline_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (STEPS, 8, 17), generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _train(model: torch.nn.Module, run) -> list[float]:
    return train_losses(model, run, _pipeline_batches())


def _placement(record) -> dict:
    """Per graph: the order of collectives and matmuls in Inductor's code, and the counts."""
    out = {}
    for graph, code in record.output_code.items():
        events = code_collective_order(code)
        out[graph] = {"events": events, "code": code,
                      "issues": sum(1 for e in events if e.startswith("issue"))}
    return out


def two_rank_job(rank: int, world: int) -> dict:
    from zeroc.sharding.state_dict import full_state_dict

    def placement(compiled) -> dict:
        (record,) = _records(compiled)
        return {"placement": _placement(record), "moved": list(record.collectives_moved)}

    results = {}
    for zero in (0, 1, 2, 3):
        # ZeRO-3's placement is read from the record of the compile that trained.
        results[zero] = train_compiled(rank, world, "gpt", zero,
                                       {"bucket_mb": 0.01, "prefetch": 1, **INDUCTOR},
                                       inspect=placement if zero == 3 else None)
        torch._dynamo.reset()
    model = zeroc.parallelize(_gpt4(), zero=0, pp=world)
    # pp_reshard=True: DualPipeV's overlapped actions run as F&B graphs (the default runs
    # them as F, the forward chunk's sends, B: no F&B graph).
    compiled = torch.compile(model, backend="zeroc", options={
        **INDUCTOR, "schedule": "dualpipev", "microbatches": 4, "pp_reshard": True})
    losses = _train(model, compiled)
    (record,) = _records(compiled)
    results["pp"] = {"losses": losses, "full": full_state_dict(model),
                     "placement": _placement(record), "moved": list(record.collectives_moved)}
    results["zero3"] = {**results[3]["inspected"],
                        "planned": [(graph, op) for graph, op, _b, _n in results[3]["collectives"]]}
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(two_rank_job, 2, timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_on_two_ranks_equal_eager(two_ranks, zero: int) -> None:
    check_parity(two_ranks[0][zero], "gpt", zero, 2)


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_dualpipev_pp2_equals_eager(two_ranks) -> None:
    eager = _gpt4()
    reference = _train(eager, eager)
    for rank in two_ranks:
        assert rank["pp"]["losses"] == pytest.approx(reference, rel=1e-5)
    assert_tensors_match(eager.state_dict(), two_ranks[0]["pp"]["full"], "dualpipev inductor")
    graphs = set(two_ranks[0]["pp"]["placement"]) | set(two_ranks[1]["pp"]["placement"])
    # DualPipeV runs forwards, I/W halves and F&B graphs on both ranks, all through Inductor.
    for kind in ("forward", "input_grad", "weight_grad", "fb"):
        assert any(f".{kind}" in g for g in graphs), (kind, sorted(graphs))
    assert all(not rank["pp"]["moved"] for rank in two_ranks)


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_zero3_collectives_stay_where_the_plan_puts_them(two_ranks) -> None:
    got = two_ranks[0]["zero3"]
    assert got["moved"] == []
    for graph in ("g0.forward", "g0.backward"):
        placement = got["placement"][graph]
        planned = [op for g, op in got["planned"] if g == graph]
        assert placement["issues"] == len(planned), (graph, placement["events"], planned)
    # Prefetch 1: the forward issues the next bucket's gather before the current bucket's
    # matmul and waits for it after; the backward reduces gradients as they are made (an
    # all-to-all on gloo, whose reduce-scatter is an all-reduce), behind the next matmul.
    FileCheck().check("all_gather_into_tensor").check("wait_tensor").check(
        "all_gather_into_tensor").check("extern_kernels.").check("wait_tensor").run(
        got["placement"]["g0.forward"]["code"])
    FileCheck().check_regex(
        "_c10d_functional.(all_reduce|reduce_scatter_tensor|all_to_all_single)").check(
        "extern_kernels.").check("wait_tensor").run(got["placement"]["g0.backward"]["code"])

