"""Generated Triton kernels really execute (``TRITON_INTERPRET=1``) and match eager aten.

Triton decides at import time whether it interprets, so the cases run in one child process
started with ``TRITON_INTERPRET=1`` in its environment; it compiles tiny models with
``kernels="triton"``, counts kernel launches, and reports the largest error against eager per
case as JSON. Each test below checks one case of that report.
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

CASES = ["pointwise", "softmax", "layernorm", "rmsnorm", "cross_entropy", "softmax_bf16"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """Run every case once in a child process under the Triton interpreter."""
    cache_dir = str(tmp_path_factory.mktemp("zeroc_cache"))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, cache_dir], env=env, text=True,
                          capture_output=True, timeout=400)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    data = json.loads(lines[-1][len("REPORT "):])
    data["_cache_files"] = sorted(os.listdir(os.path.join(cache_dir, "kernels")))
    return data


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
