"""Generated Triton kernels really execute (``TRITON_INTERPRET=1``) and match eager aten.

Triton decides at import time whether it interprets, so the cases run in one child process
started with ``TRITON_INTERPRET=1`` in its environment; it compiles tiny models with
``kernels="triton"``, counts kernel launches, and reports the largest error against eager per
case as JSON. Each test below checks one case of that report.

A second child, run at the same time, trains the zoo GPT through
``torch.compile(backend="zeroc", options={"kernels": "triton"})`` at two sequence lengths (the
second compiles a dynamic-shape graph, which is not fused) next to plain AOTAutograd, and
reports the aten ops of every graph the executor runs: what is not fused must stay the
composite ops eager runs, never their decomposed pieces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent('''
    import json, sys, types
    import torch, torch.nn as nn, torch.nn.functional as F
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    import zeroc.passes.fusion as fusion_mod
    from zeroc.codegen.fused_kernel import FusedKernel
    from zeroc.passes.base import PassContext

    launches = []
    original_launch = FusedKernel.launch
    def counting_launch(self, inputs, config=None):
        launches.append(self.ir.name)
        return original_launch(self, inputs, config)
    FusedKernel.launch = counting_launch

    class RMSNorm(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(dim))
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class GeluBias(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.bias = nn.Parameter(torch.randn(dim))
        def forward(self, x):
            return F.gelu(x + self.bias, approximate="tanh") * torch.sigmoid(x)

    class SoftmaxCE(nn.Module):
        def forward(self, x, target):
            return F.cross_entropy(torch.softmax(x, -1) * x, target)

    def layernorm(dim):
        m = nn.LayerNorm(dim)
        with torch.no_grad():
            m.weight.normal_(); m.bias.normal_()
        return m

    def run(model, args, cache_dir):
        config = types.SimpleNamespace(kernels="triton", cache_dir=cache_dir)
        kernels = []
        def compiler(kind):
            def compile_graph(gm, example_inputs):
                ctx = PassContext(config, kind, kind)
                gm = fusion_mod.fusion(gm, ctx).gm
                kernels.extend(ctx.kernels)
                return make_boxed_func(gm.forward)
            return compile_graph
        torch._dynamo.reset()
        backend = aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))
        leaves = [a for a in args if a.is_floating_point()] + list(model.parameters())
        out = torch.compile(model, backend=backend)(*args)
        out.float().square().sum().backward()
        got = [out] + [t.grad.clone() for t in leaves]
        for t in leaves:
            t.grad = None
        ref = model(*args)
        ref.float().square().sum().backward()
        want = [ref] + [t.grad for t in leaves]
        err = max(((g.float() - w.float()).abs() / (1 + w.float().abs())).max().item()
                  for g, w in zip(got, want))
        return {"err": err, "launches": len(launches), "kernels": len(kernels),
                "backends": sorted({k.backend for k in kernels})}

    cases = {
        "pointwise": lambda: (GeluBias(16), (torch.randn(4, 16, requires_grad=True),)),
        "softmax": lambda: (nn.Softmax(-1), (torch.randn(8, 32, requires_grad=True),)),
        "layernorm": lambda: (layernorm(32), (torch.randn(2, 4, 32, requires_grad=True),)),
        "rmsnorm": lambda: (RMSNorm(16), (torch.randn(8, 16, requires_grad=True),)),
        "cross_entropy": lambda: (SoftmaxCE(), (torch.randn(4, 16, requires_grad=True),
                                                torch.randint(0, 16, (4,)))),
        "softmax_bf16": lambda: (nn.Softmax(-1),
                                 (torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True),)),
    }
    report = {}
    for name, make in cases.items():
        for looped in (False, True):
            torch.manual_seed(0)
            fusion_mod.PERSISTENT_MAX_COLS = 4 if looped else 8192
            launches.clear()
            model, args = make()
            report[name + ("_looped" if looped else "")] = run(model, args, sys.argv[1])
    print("REPORT " + json.dumps(report))
''')

GPT_CHILD = textwrap.dedent('''
    import collections, json, sys
    sys.path.insert(0, sys.argv[2])
    import torch
    import zeroc
    from models.gpt import GPT, GPTConfig
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def train(model, compiled):
        losses, grads = [], []
        for seq in (8, 4):
            x, y = model.example_batch(2, seq)
            loss = compiled(x, y)
            loss.backward()
            losses.append(loss.item())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad()
        return losses, grads

    eager_graphs = []
    def recorder(kind):
        def compile_graph(gm, example_inputs):
            eager_graphs.append([kind, collections.Counter(
                str(n.target) for n in gm.graph.nodes if n.op == "call_function")])
            return make_boxed_func(gm.forward)
        return compile_graph
    eager = GPT(GPTConfig.tiny(), seed=5)
    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    ref_losses, ref_grads = train(eager, torch.compile(eager, backend=backend))
    report = {"eager": eager_graphs}
    for name, options in (("default_partition", {"partitioner": "default"}), ("min_cut", {})):
        torch._dynamo.reset()
        model = GPT(GPTConfig.tiny(), seed=5)
        compiled = torch.compile(model, backend="zeroc", options={
            "kernels": "triton", "cache_dir": sys.argv[1], **options})
        losses, grads = train(model, compiled)
        plan = zeroc.explain(compiled)
        report[name] = {
            "graphs": {g.name: collections.Counter(c.target for c in g.node_costs)
                       for g in plan.graphs if g.kind != "joint"},
            "kernels": collections.Counter(k.graph for k in plan.kernels),
            "backends": sorted({k.backend for k in plan.kernels}),
            "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "grad_err": max((g[k] - r[k]).abs().max().item()
                            for g, r in zip(grads, ref_grads) for k in r),
        }
    print("REPORT " + json.dumps(report))
''')

CASES = ["pointwise", "softmax", "layernorm", "rmsnorm", "cross_entropy", "softmax_bf16"]


def _start(script: str, args: list[str], log: str) -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    with open(log, "w") as out:  # a file, not a pipe: a full pipe would stall the child
        return subprocess.Popen([sys.executable, "-c", script, *args], env=env, text=True,
                                stdout=out, stderr=subprocess.STDOUT)


def _report_of(proc: subprocess.Popen, log: str) -> dict:
    proc.wait(timeout=400)
    with open(log) as handle:
        output = handle.read()
    lines = [ln for ln in output.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, output[-4000:]
    return json.loads(lines[-1][len("REPORT "):])


@pytest.fixture(scope="module")
def children(tmp_path_factory) -> dict:
    """Run both children at once, each under the Triton interpreter; their reports."""
    tmp = tmp_path_factory.mktemp("zeroc_cache")
    cache_dir = str(tmp / "cache")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    logs = str(tmp / "kernels.log"), str(tmp / "gpt.log")
    kernels = _start(CHILD, [cache_dir], logs[0])
    gpt = _start(GPT_CHILD, [cache_dir, tests_dir], logs[1])
    try:
        data = _report_of(kernels, logs[0])
        data["_cache_files"] = sorted(os.listdir(os.path.join(cache_dir, "kernels")))
        return {"kernels": data, "gpt": _report_of(gpt, logs[1])}
    finally:
        for proc in (kernels, gpt):
            if proc.poll() is None:
                proc.kill()


@pytest.fixture(scope="module")
def report(children) -> dict:
    """The small models' cases."""
    return children["kernels"]


@pytest.mark.timeout(450)
@pytest.mark.parametrize("looped", [False, True], ids=["persistent", "looped"])
@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_matches_aten(report, case, looped):
    result = report[case + ("_looped" if looped else "")]
    assert result["backends"] == ["triton"]
    assert result["kernels"] >= 1 and result["launches"] >= result["kernels"]
    tolerance = 2e-2 if case.endswith("bf16") else 1e-5
    assert result["err"] <= tolerance, result


@pytest.mark.timeout(450)
def test_generated_sources_are_cached_as_files(report):
    files = report["_cache_files"]
    assert files and all(f.startswith("k") and f.endswith(".py") for f in files)


# What the decompositions of layer norm and GELU (forward and backward) are made of.
DECOMPOSED_PIECES = ("aten.var_mean.correction", "aten.erf.default", "aten.rsqrt.default",
                     "aten.exp.default")


@pytest.mark.timeout(450)
@pytest.mark.parametrize("partitioner", ["default_partition", "min_cut"])
def test_gpt_matches_eager_and_fuses_the_static_graph(children, partitioner):
    run = children["gpt"][partitioner]
    assert run["loss_err"] <= 1e-5 and run["grad_err"] <= 1e-5, run
    assert run["backends"] == ["triton"]
    assert run["kernels"]["g0.forward"] >= 3 and run["kernels"]["g0.backward"] >= 3
    static_backward = run["graphs"]["g0.backward"]
    # Every layer-norm backward was decomposed and fused into kernels.
    assert static_backward.get("aten.native_layer_norm_backward.default", 0) == 0


@pytest.mark.timeout(450)
def test_gpt_second_length_runs_no_more_ops_than_eager(children):
    """The dynamic-shape graphs (no fusion) run at most as many aten ops as AOTAutograd's."""
    gpt = children["gpt"]
    eager = {kind: counts for kind, counts in gpt["eager"][2:]}  # the second sequence length
    graphs = gpt["default_partition"]["graphs"]
    for kind in ("forward", "backward"):
        ours = graphs[f"g1.{kind}"]
        assert sum(ours.values()) <= sum(eager[kind].values()), (kind, ours, eager[kind])
        assert not set(DECOMPOSED_PIECES) & set(ours), ours
        for op in ("aten.native_layer_norm.default", "aten.gelu.default",
                   "aten.native_layer_norm_backward.default", "aten.gelu_backward.default"):
            assert ours.get(op, 0) == eager[kind].get(op, 0), (kind, op)


@pytest.mark.timeout(450)
def test_gpt_second_length_keeps_composites_with_recompute(children):
    """With the default (min-cut) partitioner the backward also recomputes layer norms and
    GELUs, as whole ops too."""
    eager = {kind: counts for kind, counts in children["gpt"]["eager"][2:]}
    graphs = children["gpt"]["min_cut"]["graphs"]
    for kind in ("forward", "backward"):
        ours = graphs[f"g1.{kind}"]
        assert not set(DECOMPOSED_PIECES) & set(ours), ours
        for op in ("aten.native_layer_norm_backward.default", "aten.gelu_backward.default"):
            assert ours.get(op, 0) == eager[kind].get(op, 0), (kind, op)
    assert graphs["g1.forward"].get("aten.mul.Tensor", 0) <= eager["forward"].get(
        "aten.mul.Tensor", 0)
