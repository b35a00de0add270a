"""``zeroc::linear_cross_entropy`` in bf16: compute-dtype matmuls and the one-pass chunk kernel.

- The per-chunk step (log-sum-exp, loss, ``d loss / d logits`` written over the logits)
  against eager ``F.cross_entropy`` on float32 and bf16 logits, with ignored rows, NaN, -inf
  and +inf logits and a vocabulary spanning several blocks: the torch path in this process,
  the Triton kernel in a child process under ``TRITON_INTERPRET=1`` (Triton decides at import
  whether it interprets).
- The whole op, bf16 and float32, against eager autocast
  (``F.cross_entropy(F.linear(h, W, b).float(), t)`` under ``torch.autocast``): loss and the
  gradients of ``h``, ``W`` and ``b``, both reductions, with and without bias, one and several
  chunks, on both paths (the child forces Triton with ``ZEROC_CE_KERNEL=triton``).
- Every matrix product the op runs on bf16 inputs, forward and backward, has bf16 operands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zeroc.runtime.kernels import linear_cross_entropy as lce

CASES = textwrap.dedent('''
    import json, sys, warnings
    import torch, torch.nn.functional as F
    from zeroc.runtime.kernels import linear_cross_entropy as lce

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy, in the interpreter
    INF, NAN = float("inf"), float("nan")

    def chunk_step(kernel):
        if kernel == "torch":
            return lambda *args, block=None: lce._torch_chunk(*args)
        from zeroc.runtime.kernels.cross_entropy_triton import cross_entropy_chunk
        return cross_entropy_chunk

    def compare(got, want):
        """[max abs error where both are finite, whether NaN/inf positions agree]."""
        got, want = got.float(), want.float()
        same = bool(torch.equal(got.isnan(), want.isnan()) and
                    torch.equal(got.isinf(), want.isinf()) and
                    torch.equal(got[got.isinf()], want[want.isinf()]))
        finite = got.isfinite() & want.isfinite()
        err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
        return [err, same]

    def special_logits(dtype, vocab=37):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(10, vocab, generator=g) * 4
        t = torch.randint(0, vocab, (10,), generator=g)
        t[1] = -100                      # ignored row
        x[2, (t[2] + 1) % vocab] = NAN   # NaN off the target: NaN loss
        x[3, :20] = -INF                 # a whole first block of -inf, target finite
        t[3] = 25
        x[4] = -INF                      # only -inf: NaN
        x[5, t[5]] = -INF                # target -inf: loss inf
        t[6] = -100
        x[6, 0] = NAN                    # ignored row with NaN: loss 0, gradient NaN
        x[7, 3] = INF                    # +inf: NaN, as eager's log_softmax
        return x.to(dtype), t

    def chunk_cases(kernel):
        step = chunk_step(kernel)
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            for block in (None, 16):
                for reduction in ("mean", "sum"):
                    x, t = special_logits(dtype)
                    ref = x.float().clone().requires_grad_()
                    want_rows = F.cross_entropy(ref, t, reduction="none")
                    want_grad, = torch.autograd.grad(F.cross_entropy(ref, t, reduction=reduction),
                                                     ref)
                    count = (t != -100).sum().float()
                    scale = 1.0 / count if reduction == "mean" else torch.ones(())
                    logits, rows = x.clone(), torch.empty(len(t))
                    step(logits, t, -100, scale, rows, True, block=block)
                    name = f"{str(dtype)[6:]}_{block or 'auto'}_{reduction}"
                    # The gradient is stored in the logits' dtype, as autocast's backward casts.
                    out[name] = {"loss": compare(rows, want_rows),
                                 "grad": compare(logits, want_grad.to(dtype))}
            x, t = special_logits(dtype)
            logits, rows = x.clone(), torch.empty(len(t))
            step(logits, t, -100, torch.ones(()), rows, False, block=16)
            out[f"{str(dtype)[6:]}_no_grad"] = {
                "loss": compare(rows, F.cross_entropy(x.float(), t, reduction="none")),
                "untouched": bool(torch.equal(logits.view(-1).view(torch.int8),
                                              x.view(-1).view(torch.int8)))}
        return out

    def op_inputs(dtype, bias, seed=0, rows=70, width=32, vocab=100):
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(rows, width, generator=g)
        w = torch.randn(vocab, width, generator=g) / width ** 0.5
        b = torch.randn(vocab, generator=g) if bias else None
        t = torch.randint(0, vocab, (rows,), generator=g)
        t[[3, 40, 41]] = -100
        return [p.to(dtype).requires_grad_() if p is not None else None for p in (h, w, b)], t

    def op_cases():
        out = {}
        for dtype in (torch.bfloat16, torch.float32):
            for bias in (False, True):
                for reduction in ("mean", "sum"):
                    for chunk_rows in (None, 16):
                        (h, w, b), t = op_inputs(dtype, bias)
                        present = [p for p in (h, w, b) if p is not None]
                        with torch.autocast("cpu", dtype=torch.bfloat16,
                                            enabled=dtype == torch.bfloat16):
                            want = F.cross_entropy(F.linear(h, w, b).float(), t,
                                                   reduction=reduction)
                        want_grads = torch.autograd.grad(want, present)
                        got = lce.linear_cross_entropy(h, w, b, t, reduction=reduction,
                                                       chunk_rows=chunk_rows)
                        got_grads = torch.autograd.grad(got, present)
                        name = (f"{str(dtype)[6:]}_{'bias' if bias else 'nobias'}_{reduction}_"
                                f"{chunk_rows or 'auto'}")
                        out[name] = {
                            "loss": abs(got.float().item() - want.item()),
                            "loss_ref": abs(want.item()),
                            # Largest error relative to the largest entry of the eager gradient.
                            "grads": [((g.float() - e.float()).abs().max()
                                       / e.float().abs().max()).item()
                                      for g, e in zip(got_grads, want_grads)],
                            "dtypes": [str(g.dtype) for g in got_grads]}
            (h, w, b), t = op_inputs(dtype, True)
            t[:] = -100  # a mean over no counted rows: NaN loss, zero gradients (as eager)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                want = F.cross_entropy(F.linear(h, w, b).float(), t)
            want_grads = torch.autograd.grad(want, [h, w, b])
            got = lce.linear_cross_entropy(h, w, b, t, chunk_rows=16)
            out[f"{str(dtype)[6:]}_all_ignored"] = {
                "loss": compare(got.float().view(1), want.view(1)),
                "grads": [compare(g, e) for g, e in zip(torch.autograd.grad(got, [h, w, b]),
                                                         want_grads)],
                "zero": all(bool((e == 0).all()) for e in want_grads)}
        return out

    def report(kernel):
        return {"kernel": lce.chunk_kernel_for(torch.device("cpu")),
                "chunk": chunk_cases(kernel), "op": op_cases()}

    if __name__ == "__main__":
        print("REPORT " + json.dumps(report(sys.argv[1])))
''')

KERNELS = ["torch", "triton"]
DTYPES = ["float32", "bfloat16"]


@pytest.fixture(scope="module")
def reports() -> dict:
    """The torch path's report from this process, the Triton kernel's from a child process."""
    namespace = {"__name__": "fused_loss_cases"}
    exec(compile(CASES, "fused_loss_cases", "exec"), namespace)
    torch_report = namespace["report"]("torch")
    env = dict(os.environ, TRITON_INTERPRET="1", ZEROC_CE_KERNEL="triton", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CASES, "triton"], env=env, text=True,
                          capture_output=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return {"torch": torch_report, "triton": json.loads(lines[-1][len("REPORT "):])}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernel", KERNELS)
def test_chunk_path_is_the_one_asked_for(reports: dict, kernel: str) -> None:
    assert reports[kernel]["kernel"] == kernel


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("block", ["auto", "16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_chunk_step_matches_eager(reports: dict, kernel: str, dtype: str, block: str,
                                  reduction: str) -> None:
    """Per-row loss and gradient of the logits, NaN/inf where eager has them (block 16: the
    37-word vocabulary spans three blocks, the last one partial)."""
    case = reports[kernel]["chunk"][f"{dtype}_{block}_{reduction}"]
    loss_err, loss_same = case["loss"]
    grad_err, grad_same = case["grad"]
    assert loss_same and grad_same, case
    assert loss_err <= 1e-5, case
    # bf16: the gradient is rounded to bf16 (it is at most 1); one ulp of 1 is 2**-8.
    assert grad_err <= (1e-6 if dtype == "float32" else 2 ** -8), case


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_chunk_step_without_grad_leaves_logits(reports: dict, kernel: str, dtype: str) -> None:
    case = reports[kernel]["chunk"][f"{dtype}_no_grad"]
    assert case["loss"][1] and case["loss"][0] <= 1e-5 and case["untouched"], case


@pytest.mark.timeout(300)
@pytest.mark.parametrize("chunk_rows", ["auto", "16"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", ["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_op_matches_eager_autocast(reports: dict, kernel: str, dtype: str, bias: str,
                                   reduction: str, chunk_rows: str) -> None:
    """Loss and gradients of h, W (and b) against eager; autocast to bf16 for bf16 inputs."""
    case = reports[kernel]["op"][f"{dtype}_{bias}_{reduction}_{chunk_rows}"]
    bf16 = dtype == "bfloat16"
    assert case["dtypes"] == [f"torch.{dtype}"] * (3 if bias == "bias" else 2), case
    # The loss is float32 from the same bf16 logits; returned in h's dtype (bf16: 8 bits).
    assert case["loss"] <= (2 ** -8 if bf16 else 1e-6) * max(1.0, case["loss_ref"]), case
    assert max(case["grads"]) <= (1.6e-2 if bf16 else 1e-5), case


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_op_with_every_row_ignored(reports: dict, kernel: str, dtype: str) -> None:
    case = reports[kernel]["op"][f"{dtype}_all_ignored"]
    assert case["zero"] and case["loss"][1], case
    assert all(same and err == 0.0 for err, same in case["grads"]), case


class _MatmulDtypes(TorchDispatchMode):
    """Records the operand dtypes of every matrix product, inside the op's body too."""

    MATMULS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, list[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.zeroc.linear_cross_entropy.default:
            with self:  # the custom op is opaque to the mode: run its body under it
                return lce.loss_and_grads(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in self.MATMULS:
            # addmm/baddbmm: the operands are the two matrices after the added term.
            operands = args[1:3] if name in ("addmm", "baddbmm") else args[:2]
            self.seen.append((str(func), [a.dtype for a in operands]))
        return func(*args, **kwargs)


@pytest.mark.parametrize("chunk_rows", [0, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_matmuls_run_in_bf16(bias: bool, chunk_rows: int) -> None:
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(70, 32, generator=generator).bfloat16().requires_grad_()
    w = torch.randn(100, 32, generator=generator).bfloat16().requires_grad_()
    b = torch.randn(100, generator=generator).bfloat16().requires_grad_() if bias else None
    targets = torch.randint(0, 100, (70,), generator=generator)
    with _MatmulDtypes() as mode:
        loss = lce.linear_cross_entropy(h, w, b, targets, chunk_rows=chunk_rows)
        loss.backward()
    chunks = -(-70 // (chunk_rows or lce.chunk_rows_for(70, 32, 100)))
    # Per chunk: the logits, grad_h and grad_w products.
    assert len(mode.seen) == 3 * chunks, mode.seen
    assert all(dtypes == [torch.bfloat16] * 2 for _, dtypes in mode.seen), mode.seen
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16 and torch.isfinite(w.grad).all()


def test_chunk_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv(lce.KERNEL_ENV, raising=False)
    assert lce.chunk_kernel_for(cpu) == "torch"
    monkeypatch.setenv(lce.KERNEL_ENV, "torch")
    assert lce.chunk_kernel_for(torch.device("cuda")) == "torch"
    monkeypatch.setenv(lce.KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match="ZEROC_CE_KERNEL='cuda'; allowed: auto, triton"):
        lce.chunk_kernel_for(cpu)
    monkeypatch.setenv(lce.KERNEL_ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        lce.chunk_kernel_for(cpu)


def test_accumulation_probe_keeps_fake_and_real_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a planned world's fake tensors showed of the weight-gradient accumulation is
    remembered apart from what real tensors show: a fake CUDA probe never picks a real GPU's
    method."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(lce, "_accumulate_method", {})
    a, b = torch.ones(4, 3, dtype=torch.bfloat16), torch.ones(3, 5, dtype=torch.bfloat16)
    acc = torch.zeros(4, 5)
    lce._accumulate_mm(acc, a, b)
    assert torch.equal(acc, torch.full((4, 5), 3.0))
    with FakeTensorMode() as mode:
        fake_acc = mode.from_tensor(torch.zeros(4, 5))
        lce._accumulate_mm(fake_acc, mode.from_tensor(a), mode.from_tensor(b))
    assert lce._accumulate_method == {("cpu", False): "cast", ("cpu", True): "cast"}
