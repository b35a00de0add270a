"""The models users train now, in every layout: Qwen3, Gemma3 and five mixture-of-experts
models (GPT-OSS with expert biases, Mixtral, Qwen3-MoE with the router's auxiliary loss,
OLMoE, DeepSeek-V3) from small configs (``tests/models/hf.py``; two decoder layers), called
with ``labels=``.

Each case trains two AdamW steps compiled with zeroc and the losses, the set and values of
the gradients after the first backward and every parameter after the steps equal
single-process eager (``tests/moe_cases.py`` says on which batch). On 2 ranks every model but
Qwen3-MoE runs ZeRO-3, and every model but Qwen3-MoE and GPT-OSS runs at pp=2 with 1F1B (one
decoder layer per stage; labels partly ignored: the token mean over micro-batches). Qwen3-MoE,
whose router loss is averaged over every replica's micro-batches, runs the axes combined
instead: pp=2 x dp=2 with 1F1B and ZeRO-3 on 4 ranks (``PP_BY_DP``), which proves it under
ZeRO-3 and in a pipeline at once. GPT-OSS's pipeline is the routing case below (pp=2, 1F1B: the
gradients on two batches equal eager's). In one process (not under ``slow``) Qwen3-MoE runs
compiled without ``parallelize``; the other models' compiled graphs are the ZeRO-3 cases'.

Dropped (each property is proven elsewhere): DualPipeV on these models (DualPipeV at pp=2 on
Hugging Face decoders equals eager in ``tests/test_pipeline_dp_loss.py`` (Llama, ``labels=``),
``tests/test_pipeline_evaluation.py`` (Llama) and ``tests/test_encoder_decoder_pipeline.py``
(T5, BART)); Qwen3-MoE's separate
ZeRO-3 and pipeline cases on 2 ranks (its pp=2 x dp=2 case runs both); GPT-OSS's training
case at pp=2 (the routing case pipelines it); one-process compiles of the models that run
ZeRO-3 here. pp=2 x dp=2 with ZeRO-3 and a model's own ``labels=`` loss runs on a Hugging
Face Llama in ``tests/test_pipeline_dp_loss.py``. One ``run_ranks`` call per world size runs
all cases (a module fixture for the 2-rank one), so the suite pays for starting ranks and
importing transformers once per world size.

Routing is data-dependent: a pipeline compiled on a batch whose tokens all go to some experts
gives eager's gradients on a batch whose tokens go to others. transformers' "eager" experts
loop over the experts a batch hits (``nonzero()``), which Dynamo cannot trace into one graph:
at pp=2 that raises, saying the forward must be one graph.
"""

from __future__ import annotations

import operator
import re
import time

import pytest
import torch
from dist_harness import run_ranks

transformers = pytest.importorskip("transformers")

from models.hf import DENSE, MOE, VOCAB  # noqa: E402
from moe_cases import (  # noqa: E402
    LAYOUTS,
    SEQ,
    check_case,
    compile_case,
    eager_reference,
    make_model,
    run_case,
)
from parity import assert_tensors_match  # noqa: E402

MODELS = DENSE + MOE
PP_BY_DP = ("qwen3_moe",)  # the models of the 4-rank pp=2 x dp=2 case
ROUTED = "gpt_oss"  # the routing test's model: 3-D experts with biases
LOOPED = "mixtral"  # the eager-experts test's model
ONE_PROCESS = ("qwen3_moe",)  # compiled without parallelize (the others: their ZeRO-3 cases)
# (model, layout) on 2 ranks: ZeRO-3 for every model the 4-rank case does not run, 1F1B at
# pp=2 for those and not the routing case's model either (that case pipelines it).
TWO_RANK_CASES = tuple((name, "zero3") for name in MODELS if name not in PP_BY_DP) + tuple(
    (name, "1f1b") for name in MODELS if name not in PP_BY_DP + (ROUTED,))


def _experts_hit(model: torch.nn.Module, ids: torch.Tensor) -> list[list[set[int]]]:
    """Per sequence of ``ids``, per MoE layer: the experts its tokens are routed to (eager)."""
    hits: list[torch.Tensor] = []
    handles = [module.register_forward_hook(lambda m, args, out: hits.append(args[1]))
               for name, module in model.named_modules() if name.endswith("mlp.experts")]
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    per_layer = [index.view(ids.shape[0], -1) for index in hits]  # (sequences, tokens * top_k)
    return [[set(layer[s].tolist()) for layer in per_layer] for s in range(ids.shape[0])]


def routing_batches() -> tuple[torch.Tensor, torch.Tensor]:
    """Two batches of one repeated token each whose experts differ at every MoE layer."""
    every_token = torch.arange(VOCAB).unsqueeze(1).expand(VOCAB, SEQ)
    hits = _experts_hit(make_model(ROUTED), every_token)
    other = next(t for t in range(1, VOCAB)
                 if all(a != b for a, b in zip(hits[0], hits[t], strict=True)))
    return torch.zeros(8, SEQ, dtype=torch.long), torch.full((8, SEQ), other)


def _first_gradients(model: torch.nn.Module, run, ids: torch.Tensor) -> dict:
    loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def routing_case(batches: tuple[torch.Tensor, ...]) -> list[dict]:
    """Compiled at pp=2 on the first batch, then run on each: the gradients of each."""
    torch._dynamo.reset()
    model = make_model(ROUTED)
    compiled = compile_case(ROUTED, LAYOUTS["1f1b"], model)
    return [_first_gradients(model, compiled, ids) for ids in batches]


def looped_experts_case() -> str:
    """pp=2 with transformers' eager experts loop: the error, or "" if it ran."""
    torch._dynamo.reset()
    model = make_model(LOOPED)
    model.set_experts_implementation("eager")
    compiled = compile_case(LOOPED, LAYOUTS["1f1b"], model)
    ids = torch.zeros(8, SEQ, dtype=torch.long)
    try:
        compiled(input_ids=ids, labels=ids).loss.backward()
    except Exception as error:  # noqa: BLE001 - the test reads what was raised
        return f"{type(error).__name__}: {error}"
    return ""


def two_rank_job(rank: int, world: int, batches: tuple[torch.Tensor, ...]) -> dict:
    out: dict = {"seconds": {}}
    for name, layout in TWO_RANK_CASES:
        start = time.monotonic()
        out[name, layout] = run_case(rank, name, LAYOUTS[layout])
        out["seconds"][name, layout] = round(time.monotonic() - start, 1)
    out["routing"] = routing_case(batches)
    out["looped"] = looped_experts_case()
    return out


def four_rank_job(rank: int, world: int) -> dict:
    return {name: run_case(rank, name, LAYOUTS["pp2xdp2"]) for name in PP_BY_DP}


@pytest.fixture(scope="module")
def routing() -> tuple[torch.Tensor, torch.Tensor]:
    return routing_batches()


@pytest.fixture(scope="module")
def two_ranks(routing) -> list[dict]:
    ranks = run_ranks(two_rank_job, 2, routing, timeout=1100)
    print("seconds per case on rank 0:", ranks[0]["seconds"])  # shown with pytest -s
    return ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ONE_PROCESS)
def test_one_process_compiled_equals_eager(name: str) -> None:
    expected = eager_reference(name, LAYOUTS["compiled"])
    check_case([run_case(0, name, LAYOUTS["compiled"])], name, LAYOUTS["compiled"], expected)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(("name", "layout"), TWO_RANK_CASES)
def test_two_ranks_equal_eager(two_ranks: list[dict], name: str, layout: str) -> None:
    check_case([r[name, layout] for r in two_ranks], name, LAYOUTS[layout],
               eager_reference(name, LAYOUTS[layout]))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_pp2_by_dp2_with_zero3_equals_eager() -> None:
    ranks = run_ranks(four_rank_job, 4, timeout=1100)
    for name in PP_BY_DP:
        check_case([r[name] for r in ranks], name, LAYOUTS["pp2xdp2"],
                   eager_reference(name, LAYOUTS["pp2xdp2"]))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_pipeline_is_not_specialised_on_the_first_batchs_routing(
        two_ranks: list[dict], routing: tuple[torch.Tensor, torch.Tensor]) -> None:
    model = make_model(ROUTED)
    first, second = (_experts_hit(model, ids)[0] for ids in routing)
    assert all(a != b for a, b in zip(first, second, strict=True)), (first, second)
    for i, ids in enumerate(routing):
        expected = _first_gradients(model, model, ids)
        held = {n: g for r in two_ranks for n, g in r["routing"][i].items()}
        assert_tensors_match(expected, held, f"{ROUTED} batch {i}")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_eager_experts_loop_at_pp2_raises_for_one_graph(two_ranks: list[dict]) -> None:
    for rank in two_ranks:
        assert rank["looped"].startswith("PipelineError:"), rank["looped"]
        assert "the whole forward must be one graph" in rank["looped"], rank["looped"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_eager_experts_loop_error_names_the_models_source_line(two_ranks: list[dict]) -> None:
    message = two_ranks[0]["looped"]
    assert re.search(r"Dynamo broke the graph at \S+modeling_mixtral\.py, line \d+: "
                     r"expert_hit = .*nonzero\(\)", message), message


class _Recorder(torch.fx.Interpreter):
    """Runs a traced function, leaving each node's value in its meta as Dynamo does."""

    def run_node(self, node: torch.fx.Node):
        node.meta["example_value"] = value = super().run_node(node)
        return value


def _traced(fn) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(fn)
    _Recorder(gm).run(torch.randn(4, 4), torch.randn(4, 4))
    return gm


def _with_aux(w, x):
    aux = (w * x).mean()
    return (x @ w).mean() + 0.1 * aux, aux


def _unrelated(w, x):
    return (x @ w).mean(), (w * x).mean()


def test_the_total_of_two_scalar_losses_is_the_pipelines_loss() -> None:
    """Qwen3-MoE called with ``labels=`` returns ``.loss`` (cross-entropy plus a coefficient
    times the router's loss) and ``.aux_loss``: the pipeline trains on the one the other
    feeds into, wherever it sits; two unrelated scalars are refused."""
    from zeroc.passes.front.loss_output import rewrite_to_loss

    gm = _traced(_with_aux)
    assert rewrite_to_loss(gm, {0}).index == 0
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert output.args[0][0].target is operator.add
    swapped = _traced(lambda w, x: _with_aux(w, x)[::-1])
    assert rewrite_to_loss(swapped, {0}).index == 1
    with pytest.raises(ValueError, match="2 floating scalars that depend on the parameters"):
        rewrite_to_loss(_traced(_unrelated), {0})
