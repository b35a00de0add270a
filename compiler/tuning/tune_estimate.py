"""Estimates for ``zeroc.tune``: each candidate planned in the fake world on a profile.

``estimate_all`` returns, per candidate, ``(estimated step seconds, largest planned peak over
the ranks, why it was rejected)``. The fake world (``zeroc.explain(world=...)``) runs a fake
process group in its own process, so where a real one is initialized, rank 0 plans in a
child Python process (on a pickled ``meta`` copy of the model: no weights) and broadcasts the
results; the other ranks wait for them. The child imports the model's classes by name, so
they must live in an importable module (not in the script run as ``__main__``); a model the
child cannot load is measured in the search's default order instead, with a warning. The
child runs isolated (``python -I``) with this process's ``sys.path``, the current directory
last (``child_command``): a file there named like a package (``filelock.py``) is not imported
in place of it.
Estimating stops once half the budget is spent, leaving the rest for measuring.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroc.tuning.tune_space import Candidate

__all__ = ["estimate_all"]

log = logging.getLogger(__name__)

# (estimated step s, largest planned peak bytes, why rejected, the estimate's parts).
Estimate = tuple[float | None, int | None, str, dict[str, float]]
ESTIMATE_SHARE = 0.5  # of the budget, at most, for estimating


def _estimate(model: nn.Module, example_inputs: Any, candidate: Candidate, world: int,
              device: str, hardware: Any) -> Estimate:
    from zeroc.world.world_plan import plan_world

    try:
        plan = plan_world(model, example_inputs, world=world, pp=candidate.pp,
                          zero=candidate.zero, device=device, hardware=hardware,
                          options=candidate.options_dict(), offload=candidate.offload)
    except Exception as error:  # a candidate the model cannot take is rejected, not fatal
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        log.info("zeroc.tune: cannot plan %s: %s", candidate.label(), reason)
        return None, None, f"cannot plan: {reason}", {}
    peak = max((m.peak for m in plan.memory), default=None)
    estimate = plan.estimate
    if estimate is None:
        return None, peak, "no step estimate", {}
    parts = {"compute_s": estimate.compute_s,
             "exposed_communication_s": estimate.exposed_communication_s,
             "optimizer_s": estimate.optimizer_s, "bubble": estimate.bubble}
    step = estimate.step_s
    if candidate.offload:  # the plan's optimizer time is the device's: the host's instead
        from zeroc.tuning.tune_screen import offload_step_s

        host = max((m.host for m in plan.memory), default=0)
        offloaded = offload_step_s(host // 16)  # 16 bytes per element: master, grad, 2 moments
        step += offloaded - estimate.optimizer_s
        parts["optimizer_s"] = offloaded
    return step, peak, "", parts


def _estimate_here(model: nn.Module, example_inputs: Any, space: list[Candidate], world: int,
                   device: str, hardware: Any, budget_s: float,
                   progress: Callable[[int, int], None] | None) -> dict[Candidate, Estimate]:
    start = time.perf_counter()
    found: dict[Candidate, Estimate] = {}
    for index, candidate in enumerate(space):
        if index and time.perf_counter() - start > ESTIMATE_SHARE * budget_s:
            log.info("zeroc.tune: estimating stopped after %d of %d candidates (budget)",
                     index, len(space))
            break
        found[candidate] = _estimate(model, example_inputs, candidate, world, device, hardware)
        if progress is not None:
            progress(index + 1, len(space))
    return found


def _shapes_only(example_inputs: Any) -> Any:
    def empty(value: Any) -> Any:
        return torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(
            value, torch.Tensor) else value

    if isinstance(example_inputs, dict):
        return {k: empty(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(empty(v) for v in example_inputs)
    return empty(example_inputs)


def child_path() -> list[str]:
    """This process's ``sys.path`` with the current directory (``""``, ``"."`` or its full
    path) moved last: installed packages before anything that merely lies where it runs."""
    here = os.getcwd()
    entries = [os.path.abspath(p) if p in ("", ".") else p for p in sys.path]
    return list(dict.fromkeys([p for p in entries if p != here]
                              + [p for p in entries if p == here]))


def child_command(code: str, *args: str) -> list[str]:
    """``python -I -c code args...`` that first sets ``sys.path`` to ``child_path()``:
    isolated, so neither the current directory nor ``PYTHON*`` variables put anything ahead of
    the packages this process imports."""
    setup = "import sys; n = int(sys.argv[1]); sys.path[:] = sys.argv[2:2 + n]; " \
            "del sys.argv[1:2 + n]; "
    path = child_path()
    return [sys.executable, "-I", "-c", setup + code, str(len(path)), *path, *args]


def child_main() -> None:
    """Entry of the child process: ``python -c ... IN OUT`` (pickled arguments, results)."""
    import pickle

    torch.set_num_threads(1)
    with open(sys.argv[1], "rb") as handle:
        args = pickle.load(handle)
    found = _estimate_here(*args, None)
    with open(sys.argv[2], "wb") as handle:
        pickle.dump(found, handle)


def _estimate_in_child(model: nn.Module, example_inputs: Any, space: list[Candidate],
                       world: int, device: str, hardware: Any, budget_s: float
                       ) -> dict[Candidate, Estimate] | None:
    """``_estimate_here`` in a fresh interpreter; None (logged) when the child fails."""
    import pickle

    meta_model = copy.deepcopy(model).to("meta")
    with tempfile.TemporaryDirectory(prefix="zeroc-tune-") as tmp:
        inputs, outputs = os.path.join(tmp, "in.pkl"), os.path.join(tmp, "out.pkl")
        try:
            with open(inputs, "wb") as handle:
                pickle.dump((meta_model, _shapes_only(example_inputs), space, world, device,
                             hardware, budget_s), handle)
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            log.warning("zeroc.tune: cannot hand the model to the planning process (%s)",
                        error)
            return None
        env = dict(os.environ)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)  # the child plans alone
        code = "from zeroc.tuning.tune_estimate import child_main; child_main()"
        done = subprocess.run(child_command(code, inputs, outputs), env=env,
                              capture_output=True, text=True, timeout=max(60.0, budget_s))
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            log.warning("zeroc.tune: the planning process failed (%s); measuring in the "
                        "search's default order", tail)
            return None
        with open(outputs, "rb") as handle:
            return pickle.load(handle)


def estimate_all(model: nn.Module, example_inputs: Any, space: list[Candidate], *, world: int,
                 device: str, hardware: Any, budget_s: float,
                 progress: Callable[[int, int], None] | None = None
                 ) -> dict[Candidate, Estimate]:
    """Estimates for ``space`` (module docstring); the same dict on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return _estimate_here(model, example_inputs, space, world, device, hardware,
                              budget_s, progress)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        log.info("zeroc.tune: planning %d candidates in a child process", len(space))
        found = _estimate_in_child(model, example_inputs, space, world, device, hardware,
                                   budget_s)
        # Unplanned: every candidate competes, in the search's order (defaults first).
        box[0] = found if found is not None else {
            c: (None, None, "", {}) for c in space}
        if progress is not None:
            progress(len(space), len(space))
    dist.broadcast_object_list(box, src=0)
    return box[0]
