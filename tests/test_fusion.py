"""The fusion pass on real AOTAutograd graphs: parity with eager, kernel counts, source text.

Graphs come from ``torch.compile`` with an ``aot_autograd`` backend whose compilers run
``fusion`` on the forward and backward graphs (aten path, so the numbers must equal the
unfused graph), with and without Inductor's decompositions.
"""

from __future__ import annotations

import dataclasses
import os
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.testing import FileCheck

from zeroc.codegen import compile_cache
from zeroc.codegen.fused_kernel import FusedKernel
from zeroc.codegen.kernel_ir import KernelIR
from zeroc.codegen.triton_emit import emit_source
from zeroc.passes.base import PassContext
from zeroc.passes.fusion import fusion


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MLP(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.up, self.gate = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)) * torch.sigmoid(self.gate(x))).sum()


class LayerNormGelu(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        with torch.no_grad():
            self.norm.weight.normal_()
            self.norm.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(x), approximate="tanh")


class SoftmaxCE(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = torch.softmax(h, -1) * h
        return F.cross_entropy(h, target)


def compile_fused(model, args, kernels="aten", decompositions=None, cache_dir=None):
    """Compile ``model`` with fusion in both compilers; return (outputs, grads, contexts)."""
    config = types.SimpleNamespace(kernels=kernels, cache_dir=cache_dir)
    contexts: list[PassContext] = []

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            ctx = PassContext(config, f"g.{kind}", kind)
            contexts.append(ctx)
            result = fusion(gm, ctx)
            ctx.extras["gm"] = result.gm
            return make_boxed_func(result.gm.forward)
        return compile_graph

    backend = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                           decompositions=decompositions)
    out = torch.compile(model, backend=backend)(*args)
    return out, contexts


def check_parity(model, args, decompositions=None, tol=1e-6):
    """Fused forward and backward equal eager; return the pass contexts."""
    leaves = [a for a in args if a.is_floating_point()]
    out, contexts = compile_fused(model, args, decompositions=decompositions)
    out.sum().backward()
    grads = [t.grad.clone() for t in leaves] + [p.grad.clone() for p in model.parameters()]
    for t in leaves + list(model.parameters()):
        t.grad = None
    ref = model(*args)
    ref.sum().backward()
    ref_grads = [t.grad for t in leaves] + [p.grad for p in model.parameters()]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    return contexts


def _decomp():
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


CASES = {
    "mlp_gelu": lambda: (MLP(), (torch.randn(4, 16, requires_grad=True),)),
    "layernorm_gelu": lambda: (LayerNormGelu(), (torch.randn(2, 4, 16, requires_grad=True),)),
    "rmsnorm": lambda: (RMSNorm(16), (torch.randn(8, 16, requires_grad=True),)),
    "softmax": lambda: (nn.Softmax(-1), (torch.randn(4, 12, requires_grad=True),)),
    "cross_entropy": lambda: (SoftmaxCE(), (torch.randn(4, 16, requires_grad=True),
                                            torch.randint(0, 16, (4,)))),
}


@pytest.mark.parametrize("decomposed", [False, True], ids=["aten", "decomposed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_graph_matches_eager(case, decomposed):
    torch.manual_seed(0)
    model, args = CASES[case]()
    contexts = check_parity(model, args, _decomp() if decomposed else None,
                            tol=1e-6 if not decomposed else 1e-5)
    assert {c.kind for c in contexts} == {"forward", "backward"}
    kernels = [k for c in contexts for k in c.kernels]
    assert kernels and all(k.backend == "aten" for k in kernels)


def _kernels(model, args, decompositions=None):
    _, contexts = compile_fused(model, args, decompositions=decompositions)
    return {c.kind: c.kernels for c in contexts}


@pytest.mark.parametrize("decomposed", [False, True], ids=["aten", "decomposed"])
def test_layernorm_forward_is_one_kernel(decomposed):
    with torch.no_grad():
        kernels = _kernels(nn.LayerNorm(16), (torch.randn(4, 16),),
                           _decomp() if decomposed else None)
    [kernel] = kernels["forward"]
    assert kernel.kind == "reduction" and kernel.numel == 64
    FileCheck().check("@triton.jit").check("def zeroc_red_0").check("tl.sum") \
        .check("tl.rsqrt").check_count("tl.store(", 1, exactly=True).run(kernel.source)


def test_softmax_and_rmsnorm_forward_kernel_counts():
    with torch.no_grad():
        softmax = _kernels(nn.Softmax(-1), (torch.randn(4, 16),))["forward"]
        rms = _kernels(RMSNorm(16), (torch.randn(4, 16),))["forward"]
    assert len(softmax) == 1 and len(rms) == 1
    FileCheck().check("tl.max").check("tl.exp").check("tl.sum").run(softmax[0].source)
    assert rms[0].ops == ("aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.add.Tensor",
                          "aten.rsqrt.default", "aten.mul.Tensor", "aten.mul.Tensor")


def test_rmsnorm_and_softmax_backward_fuse_into_one_kernel():
    torch.manual_seed(0)
    model, args = CASES["cross_entropy"]()
    contexts = check_parity(model, args)
    backward = [c for c in contexts if c.kind == "backward"][0]
    assert len(backward.kernels) == 1
    assert backward.kernels[0].ops.count("aten.sum.dim_IntList") == 1


def test_pointwise_chain_source_and_graph():
    def gelu_bias(x, b):
        return F.gelu(x + b) * 2.0

    with torch.no_grad():
        out, contexts = compile_fused(gelu_bias, (torch.randn(8, 16), torch.randn(16)))
    [kernel] = contexts[0].kernels
    assert kernel.kind == "pointwise" and kernel.name == "zeroc_poi_0"
    FileCheck().check("offs = tl.program_id(0) * BLOCK").check("offs % C").check("tl.erf") \
        .check_not("tl.sum").check("tl.store").run(kernel.source)


def test_kernel_ir_is_immutable_and_looped_emission(tmp_path):
    with torch.no_grad():
        _, contexts = compile_fused(nn.Softmax(-1), (torch.randn(4, 16),),
                                    cache_dir=str(tmp_path))
    info = contexts[0].kernels[0]
    module = compile_cache.load_module(info.source, str(tmp_path))
    assert module.__file__.startswith(str(tmp_path))
    assert os.path.basename(module.__file__) == f"k{info.source_hash}.py"
    ir = _ir_of(contexts)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ir.rows = 3
    looped = emit_source(dataclasses.replace(ir, persistent=False))
    FileCheck().check("for c0 in range(0, C, BLOCK_C)").check("acc_").check("tl.max(acc_") \
        .check("for c0 in range(0, C, BLOCK_C)").check("tl.sum(acc_") \
        .check("for c0 in range(0, C, BLOCK_C)").check("tl.store").run(looped)


def _ir_of(contexts) -> KernelIR:
    gm = contexts[0].extras["gm"]
    return next(n.target.ir for n in gm.graph.nodes if isinstance(n.target, FusedKernel))


def _traced_softmax():
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(lambda x: torch.softmax(x, -1), tracing_mode="fake")(torch.randn(4, 16))


def test_kernels_option_is_checked(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = types.SimpleNamespace(kernels="triton", cache_dir=None)
    with pytest.raises(ValueError, match="kernels='triton'.*TRITON_INTERPRET=1.*'auto'"):
        fusion(_traced_softmax(), PassContext(config, "g", "inference"))
    config = types.SimpleNamespace(kernels="cuda", cache_dir=None)
    with pytest.raises(ValueError, match="option 'kernels' is 'cuda'; allowed: 'auto'"):
        fusion(_traced_softmax(), PassContext(config, "g", "inference"))


def test_pass_result_stats_and_graph_meta():
    gm = _traced_softmax()
    config = types.SimpleNamespace(kernels="auto", cache_dir=None)
    ctx = PassContext(config, "g0.inference", "inference")
    result = fusion(gm, ctx)
    assert result.changed and result.stats == {"kernels": 1, "fused_ops": 1}
    [node] = [n for n in result.gm.graph.nodes if isinstance(n.target, FusedKernel)]
    assert node.meta["val"].shape == (4, 16)
    assert ctx.kernels[0].graph == "g0.inference" and ctx.kernels[0].backend == "aten"
    x = torch.randn(4, 16)
    torch.testing.assert_close(result.gm(x), torch.softmax(x, -1), rtol=0, atol=0)


def test_matmul_and_indexing_stay_aten():
    def f(x, w, idx):
        return torch.softmax(x @ w, -1)[idx]

    with torch.no_grad():
        args = (torch.randn(4, 8), torch.randn(8, 8), torch.tensor([0, 2]))
        out, contexts = compile_fused(f, args)
    torch.testing.assert_close(out, f(*args), rtol=0, atol=0)
    assert all("mm" not in op and "index" not in op
               for k in contexts[0].kernels for op in k.ops)


class NormMLP(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(self.norm(x))).sum()


def test_fusion_off_keeps_layer_norm_and_gelu_whole(monkeypatch, tmp_path):
    """``fusion=False`` with zeroc's Triton kernels: nothing is fused, so nothing is
    decomposed; the graphs run the composite ops eager runs (no var_mean/erf pieces)."""
    import zeroc

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernels="triton" on CPU; nothing launches
    torch.manual_seed(0)
    model, x = NormMLP(), torch.randn(2, 4, 16, requires_grad=True)
    compiled = torch.compile(model, backend="zeroc", options={
        "kernels": "triton", "fusion": False, "cache_dir": str(tmp_path)})
    compiled(x).backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    model(x).backward()
    for got, want in zip(grads, [x.grad] + [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    plan = zeroc.explain(compiled)
    assert plan.kernels == ()
    ops = {g.name: [c.target for c in g.node_costs] for g in plan.graphs}
    assert ops["g0.forward"].count("aten.native_layer_norm.default") == 1
    assert ops["g0.forward"].count("aten.gelu.default") == 1
    assert ops["g0.backward"].count("aten.native_layer_norm_backward.default") == 1
    assert ops["g0.backward"].count("aten.gelu_backward.default") == 1
    pieces = {"aten.var_mean.correction", "aten.erf.default", "aten.rsqrt.default"}
    assert not pieces & {op for graph in ops.values() for op in graph}


def test_outputs_that_may_alias_an_input_are_found_statically():
    from torch.fx.experimental.proxy_tensor import make_fx

    from zeroc.codegen.fused_kernel import aliasing_outputs

    def group(x, y):
        # a view of an input, a fresh value, a view of a fresh value, a view of a view of an
        # input, and a fresh output of a multi-output op
        mean = torch.ops.aten.native_layer_norm.default(x, [4], None, None, 1e-5)[1]
        return x.view(-1), x + 1, (y * 2).t(), y.t().unsqueeze(0), mean

    gm = make_fx(group)(torch.randn(2, 4), torch.randn(4, 3))
    assert aliasing_outputs(gm) == (0, 3)
