"""Executes compiled graphs on this rank.

A ``GraphExecutor`` runs one functional graph produced by the pass pipeline. It uses the
boxed calling convention AOTAutograd expects: it empties the caller's argument list, so the
caller keeps no reference to inputs (saved activations) once the graph has run.

While a ``torch.profiler`` records, each call runs inside ``record_function("zeroc/<name>")``
(e.g. ``zeroc/g0.forward``), so the graph and the ZeRO waits in it show in the user's trace.
``record`` is that helper for the other runtime and codegen call sites: without an active
profiler it returns a shared no-op context, so the hot paths pay one C++ flag check.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from zeroc.runtime.collectives import ISSUE_OPS
from zeroc.runtime.errors import CollectiveError
from zeroc.runtime.step_memory import tracking, tracking_scope
from zeroc.runtime.torch_compat import profiler_enabled

log = logging.getLogger(__name__)

# Words of the messages a failed or timed-out collective raises with (gloo's "Connection
# closed by peer" and "Timed out", NCCL's watchdog, the c10d store) besides torch.distributed's
# own DistError types.
_COLLECTIVE_FAILURE_WORDS = ("connection closed", "connection reset", "connection refused",
                             "broken pipe", "timed out", "timeout", "gloo", "nccl", "c10d",
                             "watchdog", "tcpstore", "socket", "by peer")
PROFILE_PREFIX = "zeroc/"
_NOT_RECORDING = contextlib.nullcontext()


def collective_failed(error: BaseException) -> bool:
    """Whether ``error`` says a collective failed or timed out (another rank died or hung),
    rather than an op of this rank's own (a dtype or shape error)."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    message = str(error).lower()
    return any(word in message for word in _COLLECTIVE_FAILURE_WORDS)


def profiling() -> bool:
    """Whether a torch profiler is recording now."""
    return profiler_enabled()


def record(name: str) -> contextlib.AbstractContextManager[Any]:
    """``torch.profiler.record_function(name)`` while a profiler records, else a no-op."""
    return torch.profiler.record_function(name) if profiler_enabled() else _NOT_RECORDING


class GraphExecutor:
    """Run a compiled functional ``GraphModule``; ``name`` is its name in the plan."""

    def __init__(self, gm: torch.fx.GraphModule, name: str,
                 run_boxed: Callable[[list[Any]], Any] | None = None) -> None:
        # An instance attribute, so that wrappers made with functools.wraps (Dynamo's
        # disable() around the backward) copy it and still call us boxed.
        self._boxed_call = True
        self.gm = gm
        self.name = name
        self.calls = 0
        # What runs the graph: the GraphModule itself, or its compiled form (Inductor's),
        # called with the boxed convention.
        self.run_boxed = run_boxed
        self.communicates = any(
            n.op == "call_function" and n.target in ISSUE_OPS for n in gm.graph.nodes)
        self.profile_name = PROFILE_PREFIX + name

    def __call__(self, args: list[Any]) -> Any:
        if self.calls == 0:
            log.debug("zeroc: running %s for the first time", self.name)
        self.calls += 1
        inputs = list(args)
        args.clear()
        with record(self.profile_name):
            if not tracking():
                return self._run(inputs)
            with tracking_scope():
                return self._run(inputs)

    def _call(self, inputs: list[Any]) -> Any:
        if self.run_boxed is not None:
            return self.run_boxed(inputs)
        return self.gm(*inputs)

    def _run(self, inputs: list[Any]) -> Any:
        if not self.communicates:
            return self._call(inputs)
        try:
            return self._call(inputs)
        except RuntimeError as error:
            if not collective_failed(error):
                raise  # this rank's own error: as it is, without a guess about the others
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise CollectiveError(
                f"zeroc: rank {rank} failed in {self.name}, a graph with collectives: "
                f"{str(error).splitlines()[0] if str(error) else type(error).__name__}. "
                "Another rank probably died, hung past the process group's timeout, or ran "
                "a different graph; look at the other ranks' logs."
            ) from error

    def __repr__(self) -> str:
        return f"GraphExecutor({self.name}, calls={self.calls})"
