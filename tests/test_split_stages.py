"""Stage split, micro-batch reshaping, I/W split and F&B graphs on one process.

The zoo GPT and Llama are captured by Dynamo (a backend that keeps the graph), re-shaped for
one micro-batch and cut into stages; running the stage graphs one after the other must give
the eager loss of that micro-batch. The backward split into I and W must reproduce the full
backward, with W holding only weight-gradient work.
"""

from __future__ import annotations

import pytest
import torch
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from torch._functorch.aot_autograd import aot_export_joint_simple
from torch._functorch.partitioners import min_cut_rematerialization_partition

from zeroc.passes.front.microbatch_shapes import shrink_to_microbatch
from zeroc.passes.front.split_stages import cut_stages
from zeroc.passes.program.overlap_fb import interleave
from zeroc.passes.program.split_weight_grad import split_backward

BATCH, MICRO = 4, 2


def make(kind: str, layers: int) -> torch.nn.Module:
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, d_model=32))
    return Llama(LlamaConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, d_model=32,
                             ffn_hidden=64))


def capture(model: torch.nn.Module):
    """The Dynamo graph of ``model(x, y)``, its inputs, parameter and batch input indices."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    x, y = model.example_batch(BATCH)
    torch.compile(model, backend=keep)(x, y)
    (gm, inputs), = graphs
    params = {i for i, v in enumerate(inputs) if isinstance(v, torch.nn.Parameter)}
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    batch = {names.index("l_idx_"), names.index("l_targets_")}
    return gm, inputs, params, batch, (x, y)


def run_stages(split, inputs, batch):
    message: dict[str, torch.Tensor] = {}
    outs = ()
    for spec in split.stages:
        args = ([inputs[i] for i in spec.param_inputs]
                + [inputs[i][:MICRO] if i in batch else inputs[i] for i in spec.local_inputs]
                + [message[k] for k in spec.in_keys])
        outs = spec.gm(*args)
        message.update(zip(spec.out_keys, outs, strict=False))
    return outs[-1]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("stages", [2, 4, 8])
def test_stage_graphs_compose_to_the_model(kind: str, stages: int) -> None:
    model = make(kind, 8)
    gm, inputs, params, batch, (x, y) = capture(model)
    mgraph = shrink_to_microbatch(gm, inputs, batch, BATCH, MICRO)
    split = cut_stages(mgraph, stages, params)
    assert len(split.stages) == stages
    assert all(any(u.startswith("layers.") for u in s.units) for s in split.stages)
    assert "tok_emb" in split.stages[0].units and "lm_head" in split.stages[-1].units
    # Only the residual stream travels; positions, targets and rotary tables are local.
    assert all(len(m) == 1 for m in split.messages)
    expected = model(x[:MICRO], y[:MICRO])
    torch.testing.assert_close(run_stages(split, inputs, batch), expected)


def test_views_take_the_micro_batch_size() -> None:
    gm, inputs, params, batch, _ = capture(make("gpt", 2))
    mgraph = shrink_to_microbatch(gm, inputs, batch, BATCH, MICRO)
    views = [n for n in mgraph.gm.graph.nodes if n.op == "call_method" and n.target == "view"]
    heads = [n.args[1:] for n in views if len(n.args) == 5]
    assert heads and all(sizes[0] == MICRO for sizes in heads)
    assert all(tuple(v.shape)[0] == MICRO for k, v in mgraph.values.items()
               if k.startswith("layer_norm"))


def test_balanced_split_weighs_embedding_and_head() -> None:
    gm, inputs, params, batch, _ = capture(make("gpt", 4))
    split = cut_stages(shrink_to_microbatch(gm, inputs, batch, BATCH, MICRO), 2, params)
    costs = dict(split.unit_costs)
    assert costs["tok_emb"] > 0 and costs["lm_head"] > 0
    assert split.stages[0].units == ("tok_emb", "drop", "layers.0", "layers.1")
    assert split.stages[1].units == ("layers.2", "layers.3", "ln_f", "lm_head")
    assert all(s.flops > 0 and s.activation_bytes > 0 for s in split.stages)


def test_pinned_split_points() -> None:
    gm, inputs, params, batch, (x, y) = capture(make("llama", 4))
    mgraph = shrink_to_microbatch(gm, inputs, batch, BATCH, MICRO)
    split = cut_stages(mgraph, 2, params, split_points=["layers.3"])
    assert split.stages[1].units == ("layers.3", "norm", "lm_head")
    torch.testing.assert_close(run_stages(split, inputs, batch),
                               make("llama", 4)(x[:MICRO], y[:MICRO]))


@pytest.mark.parametrize(
    ("stages", "points", "message"),
    [
        (4, None, "has 2 layers"),
        (2, ["layers.7"], r"'layers.7' is not one of the model's blocks; .*: layers.0, layers.1$"),
        (2, ["lm_head"], r"'lm_head' is not one of the model's blocks"),
        (2, ["layers.1", "lm_head"], "stages need 1"),
    ],
)
def test_split_errors(stages: int, points, message: str) -> None:
    """A split point must be a block; the error lists the blocks found."""
    gm, inputs, params, batch, _ = capture(make("gpt", 2))
    mgraph = shrink_to_microbatch(gm, inputs, batch, BATCH, MICRO)
    with pytest.raises(ValueError, match=message):
        cut_stages(mgraph, stages, params, points)


def stage_backward(kind: str):
    model = make(kind, 2)
    gm, inputs, params, batch, _ = capture(model)
    split = cut_stages(shrink_to_microbatch(gm, inputs, batch, BATCH, MICRO), 2, params)
    spec = split.stages[1]
    shape, dtype, _ = split.values[spec.in_keys[0]]
    act = torch.randn(shape, dtype=dtype, requires_grad=True)
    args = ([inputs[i] for i in spec.param_inputs]
            + [inputs[i][:MICRO] if i in batch else inputs[i] for i in spec.local_inputs] + [act])
    joint = aot_export_joint_simple(spec.gm, args, trace_joint=True)
    fw, bw = min_cut_rematerialization_partition(joint, args, num_fwd_outputs=1)
    outs = fw(*args)
    bw_args = list(outs[1:]) + [torch.tensor(1.0)]
    return spec, fw, bw, args, bw_args


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_weight_grad_split_reproduces_backward(kind: str) -> None:
    spec, _, bw, _, bw_args = stage_backward(kind)
    n_params = len(spec.param_inputs)
    full = bw(*bw_args)
    parts = split_backward(bw, n_params)
    i_outs = parts.input_grad(*bw_args)
    input_grads = i_outs[:parts.num_input_grads]
    stash = list(i_outs[parts.num_input_grads:])
    weight_grads = parts.weight_grad(*stash, *[bw_args[j] for j in parts.w_inputs])
    assert len(weight_grads) == n_params
    for got, expected in zip(list(weight_grads) + list(input_grads), full, strict=True):
        if expected is None:
            assert got is None
        else:
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # W holds only weight-gradient work: none of its nodes feeds an input gradient, and the
    # matmuls of the weight gradients (one per Linear weight) moved out of I.
    assert parts.w_nodes > 0 and parts.i_nodes > 0
    w_mm = [n for n in parts.weight_grad.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert len(w_mm) >= 4


def test_overlapped_graph_equals_forward_then_backward() -> None:
    _, fw, bw, args, bw_args = stage_backward("gpt")
    merged = interleave(fw, bw)
    separate = list(fw(*args)) + list(bw(*bw_args))
    together = merged(*args, *bw_args)
    assert len(together) == len(separate)
    for got, expected in zip(together, separate, strict=True):
        if expected is None:
            assert got is None
        else:
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    order = [n.name for n in merged.graph.nodes if n.op == "call_function"]
    forward_ops = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    # Interleaved, not concatenated: a backward node runs before the forward's last node.
    first_backward = next(i for i, name in enumerate(order) if name not in forward_ops)
    assert first_backward < len(forward_ops) - 1


class Wrapped(torch.nn.Module):
    """A user module around the zoo model: its blocks live at ``inner.body.layers.N``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = torch.nn.ModuleDict({"body": model})

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.inner["body"](idx, targets)

    def example_batch(self, batch: int):
        return self.inner["body"].example_batch(batch)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_blocks_are_found_at_any_depth(kind: str) -> None:
    model = Wrapped(make(kind, 4))
    gm, inputs, params, batch, (x, y) = capture(model)
    mgraph = shrink_to_microbatch(gm, inputs, batch, BATCH, MICRO)
    split = cut_stages(mgraph, 4, params)
    assert [s.units[0] for s in split.stages[1:]] == [
        f"inner.body.layers.{i}" for i in (1, 2, 3)]
    pinned = cut_stages(mgraph, 2, params, split_points=["inner.body.layers.3"])
    assert pinned.stages[1].units[0] == "inner.body.layers.3"
    expected = model(x[:MICRO], y[:MICRO])
    for result in (split, pinned):
        torch.testing.assert_close(run_stages(result, inputs, batch), expected)
    with pytest.raises(ValueError, match=r"'layers.3' is not one of the model's blocks; .*"
                                         r"inner.body.layers.0, inner.body.layers.1"):
        cut_stages(mgraph, 2, params, split_points=["layers.3"])


def _collective_then_compute() -> torch.fx.GraphModule:
    """``relu(inputs @ all_gather(weight_shard))``: a gather whose wait comes at once."""
    functional = torch.ops._c10d_functional
    graph = torch.fx.Graph()
    inputs = graph.placeholder("inputs")
    weight_shard = graph.placeholder("weight_shard")
    issue = graph.call_function(functional.all_gather_into_tensor.default,
                                (weight_shard, 2, "0"))
    weight = graph.call_function(functional.wait_tensor.default, (issue,))
    out = graph.call_function(torch.ops.aten.relu.default,
                              (graph.call_function(torch.ops.aten.mm.default, (inputs, weight)),))
    graph.output((out,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _compute_only() -> torch.fx.GraphModule:
    """``(square @ square) @ (square @ square)``: compute and no collective."""
    graph = torch.fx.Graph()
    square = graph.placeholder("square")
    once = graph.call_function(torch.ops.aten.mm.default, (square, square))
    graph.output((graph.call_function(torch.ops.aten.mm.default, (once, once)),))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("collective_side", ["forward", "backward"])
def test_overlapped_graph_puts_the_other_chunks_compute_between_issue_and_wait(
        collective_side: str) -> None:
    """With collectives inside the stage graphs (pp_reshard=True) the F&B graph issues one
    chunk's collective, runs the other chunk's compute, then waits, whatever the progress
    fractions would pick."""
    graphs = (_collective_then_compute(), _compute_only())
    if collective_side == "backward":
        graphs = graphs[::-1]
    order = [n for n in interleave(*graphs).graph.nodes if n.op == "call_function"]
    names = [str(n.target) for n in order]
    issue = next(i for i, n in enumerate(names) if "all_gather" in n)
    wait = next(i for i, n in enumerate(names) if "wait_tensor" in n)
    between = names[issue + 1:wait]
    assert issue < wait and any("aten.mm" in n for n in between), names
