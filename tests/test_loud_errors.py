"""Loud instead of silent: a launcher's world without a process group, pipeline options at pp=1,
and no deprecation warnings from zeroc's own calls.

- ``parallelize`` with ``WORLD_SIZE`` > 1 and no process group raises, naming
  ``init_process_group``, and leaves the model as it was.
- Every pipeline-only option (``PIPELINE_OPTIONS``, checked against the Config docs) given to a
  pp=1 model warns once per process, naming the option; the model still trains as eager does;
  a bad value still raises.
- On 2 gloo ranks (ZeRO-1, ZeRO-3, and a pp=2 pipeline with pipeline options), and while
  importing every zeroc module, no ``DeprecationWarning`` / ``FutureWarning`` comes from a
  call in zeroc's files: a warning counts as zeroc's when the innermost frame outside torch
  (and ``warnings`` / ``typing_extensions`` / importlib) is in zeroc, since torch's
  ``@deprecated`` wrappers (``c10d_logger``) report their own file.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import traceback
import warnings

import pytest
import torch
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig

import zeroc
from zeroc.frontend import backend as backend_module
from zeroc.frontend.config import PIPELINE_OPTIONS, Config
from zeroc.sharding.parallelize import layout_of

PIPELINE_WARNING = "apply only to pipelines"


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))


@pytest.fixture(autouse=True)
def warn_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the pp=1 warning as a fresh process would."""
    monkeypatch.setattr(backend_module, "_WARNED", set())


def test_world_size_without_process_group_raises_naming_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2.*init_process_group"):
        zeroc.parallelize(model, zero=3)
    assert layout_of(model) is None  # untouched: the fix can be applied and parallelize rerun
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert layout_of(zeroc.parallelize(model, zero=3)).world == 1


def test_pipeline_options_are_the_documented_pp_only_ones() -> None:
    entries = re.split(r"\n    (?=\w+: )", Config.__doc__ or "")
    documented = {e.split(":")[0] for e in entries[1:] if "pp > 1" in " ".join(e.split())}
    assert documented == set(PIPELINE_OPTIONS)
    assert set(PIPELINE_OPTIONS) <= {f for f in Config.__dataclass_fields__}


def _train(options: dict) -> tuple[list[warnings.WarningMessage], torch.Tensor, torch.Tensor]:
    """Loss and first-layer gradient of the compiled pp=1 model, and the warnings it gave."""
    model = zeroc.parallelize(tiny(), zero=3)
    compiled = torch.compile(model, backend="zeroc", options=options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = compiled(torch.ones(4, 8)).square().sum()
        loss.backward()
    grad = model[0].weight.grad
    return [w for w in caught if PIPELINE_WARNING in str(w.message)], loss.detach(), grad


@pytest.mark.parametrize(("key", "value"), [
    ("schedule", "gpipe"), ("microbatches", 2), ("split_points", ["2"]),
    ("loss_reduction", "sum"), ("pp_reshard", True),
])
def test_pipeline_option_at_pp1_warns_once_and_is_ignored(key: str, value: object) -> None:
    eager = tiny()
    want = eager(torch.ones(4, 8)).square().sum()
    want.backward()
    caught, loss, grad = _train({key: value})
    assert len(caught) == 1 and f"{key}={value!r}" in str(caught[0].message)
    assert "pp >= 2" in str(caught[0].message) and issubclass(caught[0].category, UserWarning)
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(grad, eager[0].weight.grad)
    again, _, _ = _train({key: value})  # the same options again: warned already
    assert again == []


def test_other_options_do_not_warn_and_bad_values_still_raise() -> None:
    assert _train({"prefetch": 2, "bucket_mb": 1.0})[0] == []
    model = zeroc.parallelize(tiny(), zero=3)
    compiled = torch.compile(model, backend="zeroc", options={"schedule": "zigzag"})
    with pytest.raises(ValueError, match=r"schedule='zigzag'.*gpipe"):
        compiled(torch.ones(4, 8))


def _zeroc_roots() -> list[str]:
    """The folders of zeroc's four packages."""
    import zeroc.codegen
    import zeroc.passes
    import zeroc.runtime

    return [os.path.dirname(m.__file__) + os.sep
            for m in (zeroc, zeroc.passes, zeroc.codegen, zeroc.runtime)]


def _ours(stack: list, roots: list[str], torch_dir: str) -> str:
    """``file:line`` of the innermost frame outside torch and the warning machinery when it is
    in zeroc's folders ``roots``, else ``""``.

    A warning raised while that frame imports a torch module counts only when the module warns
    at its top level (a deprecated module); torch's own modules calling deprecated torch APIs
    as they load (``torch.utils.mkldnn``, imported with Inductor) are torch's.
    """
    def machinery(path: str) -> bool:
        return "typing_extensions" in path or os.path.basename(path) == "warnings.py"

    for index in range(len(stack) - 1, -1, -1):
        path = stack[index].filename
        path = path if path.startswith("<") else os.path.abspath(path)
        if path.startswith((torch_dir, "<frozen importlib")) or machinery(path):
            continue
        if not path.startswith(tuple(roots)):
            return ""
        inner = stack[index + 1:]
        if any(f.filename.startswith("<frozen importlib") for f in inner):
            warner = next((f for f in reversed(inner) if not machinery(f.filename)), None)
            if warner is None or warner.name != "<module>":
                return ""
        return f"{path}:{stack[index].lineno}"
    return ""


def _recorder(caught: list, roots: list[str], torch_dir: str):
    """A ``showwarning`` that keeps (category, message, zeroc caller) of zeroc's deprecations.

    Uses only ``os``, ``traceback`` and ``_ours``, so it can run before torch is imported.
    """
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, (DeprecationWarning, FutureWarning, PendingDeprecationWarning)):
            where = _ours(traceback.extract_stack()[:-1], roots, torch_dir)
            if where:
                caught.append((category.__name__, str(message)[:200], where))
    return show


TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def distributed_job(rank: int, world: int) -> dict:
    """ZeRO-1, ZeRO-3 (pp=1) and a pp=2 pipeline, each trained for a step."""
    caught: list[tuple[str, str, str]] = []
    pipeline_warnings = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _recorder(caught, _zeroc_roots(), TORCH_DIR)
        for zero in (1, 3):
            model = zeroc.parallelize(tiny(), zero=zero)
            compiled = torch.compile(model, backend="zeroc")
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            compiled(torch.randn(4, 8)).sum().backward()
            zeroc.clip_grad_norm_(model, 1.0)
            optimizer.step()
            zeroc.full_state_dict(model)
            zeroc.explain(compiled)
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as pp_caught:
            warnings.simplefilter("always")
            gpt = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=5), zero=3, pp=2)
            compiled = torch.compile(gpt, backend="zeroc",
                                     options={"schedule": "gpipe", "microbatches": 2})
            tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
            compiled(tokens, tokens).backward()
            zeroc.explain(compiled)
        pipeline_warnings = [str(w.message) for w in pp_caught
                             if PIPELINE_WARNING in str(w.message)]
        for w in pp_caught:  # record=True swallowed them: judge them the same way
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return {"deprecations": caught, "pipeline_warnings": pipeline_warnings}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_no_deprecation_warnings_from_zeroc_on_two_ranks() -> None:
    for rank, result in enumerate(run_ranks(distributed_job, 2, timeout=240)):
        assert result["deprecations"] == [], f"rank {rank}: {result['deprecations']}"
        assert result["pipeline_warnings"] == [], "pp=2 must not warn about pipeline options"


IMPORT_ALL = """
import importlib, os, pkgutil, traceback, warnings
{functions}
caught = []
warnings.simplefilter("always")
warnings.showwarning = _recorder(caught, {roots!r}, {torch_dir!r})
import zeroc, zeroc.codegen, zeroc.passes, zeroc.runtime
for package in (zeroc, zeroc.passes, zeroc.codegen, zeroc.runtime):
    for module in pkgutil.iter_modules(package.__path__):
        if module.name != "__main__":
            importlib.import_module(package.__name__ + "." + module.name)
print(caught)
"""


def test_importing_every_module_gives_no_deprecation_warning() -> None:
    """In a fresh interpreter, the hook is set before torch and zeroc are imported."""
    functions = inspect.getsource(_ours) + "\n" + inspect.getsource(_recorder)
    code = IMPORT_ALL.format(functions=functions, roots=_zeroc_roots(), torch_dir=TORCH_DIR)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
