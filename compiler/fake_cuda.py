"""CUDA tensors without a GPU, for planning: fake tensors on a ``cuda`` device and a backward
that runs without the autograd engine.

``FakeTensorMode`` makes tensors that carry a device, a shape and a dtype but no data; it
raises on any device mix, which is what the fake world checks. On a CPU-only build of torch
two things still need a GPU:

- every op that opens a device guard (``mm``, ``linear``, ...) aborts the process ("PyTorch is
  not linked with support for cuda devices"): ``ensure_fake_cuda`` registers a no-op CUDA device
  guard (a few lines of C++ built once with ``torch.utils.cpp_extension``; only where torch has
  no CUDA guard of its own);
- the autograd engine refuses CUDA tensors when no accelerator exists: ``run_backward`` walks
  the autograd graph itself, calling each node with its gradients in dependency order. Calling
  an ``AccumulateGrad`` node sets ``.grad`` and runs the post-accumulate hooks, as the engine
  does.

Only the planning path (``zeroc.fake_world``) uses these; training never does.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

import torch

__all__ = ["ensure_fake_cuda", "run_backward"]

log = logging.getLogger(__name__)

_GUARD_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
namespace {
const c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA> no_op_cuda_guard;
}
bool install_no_op_cuda_guard() {
  auto& slot = c10::impl::device_guard_impl_registry[
      static_cast<size_t>(c10::DeviceType::CUDA)];
  if (slot.load() != nullptr) return false;
  slot.store(&no_op_cuda_guard);
  return true;
}
"""
_LOCK = threading.Lock()
_INSTALLED = False


def ensure_fake_cuda() -> None:
    """Make fake ``cuda`` tensors usable on this build (a no-op where torch has CUDA)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED or torch.backends.cuda.is_built():
            _INSTALLED = True
            return
        from torch.utils.cpp_extension import load_inline

        log.info("building the no-op CUDA device guard for planning on a CPU-only torch")
        try:
            module = load_inline("zeroc_fake_cuda_guard", cpp_sources=[_GUARD_SOURCE],
                                 functions=["install_no_op_cuda_guard"], verbose=False)
        except Exception as error:  # no compiler, no headers
            raise RuntimeError(
                "zeroc: planning for device='cuda' on a CPU-only torch needs a C++ compiler "
                f"to build a no-op CUDA device guard, and building it failed: {error}. Plan "
                "with device='cpu', or install g++ (or a CUDA build of torch)") from None
        module.install_no_op_cuda_guard()
        _INSTALLED = True


def _reachable(root: Any) -> collections.Counter:
    """How many edges lead into each node reachable from ``root``."""
    incoming: collections.Counter = collections.Counter()
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            incoming[child] += 1
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return incoming


def run_backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` without the autograd engine (for fake CUDA tensors).

    Each node runs once all its consumers have given their gradients; gradients arriving at
    one output of a node from several consumers are summed, as the engine sums them."""
    root = loss.grad_fn
    if root is None:
        raise RuntimeError("zeroc fake world: the loss does not require grad")
    incoming = _reachable(root)
    buffers: dict[Any, dict[int, torch.Tensor]] = {root: {0: torch.ones_like(loss)}}
    ready = [root]
    while ready:
        node = ready.pop()
        received = buffers.pop(node, {})
        # One gradient per output of the node's forward (None where nothing flowed back).
        metadata = getattr(node, "_input_metadata", None)
        width = max(max(received, default=0) + 1, len(metadata) if metadata else 0)
        # C++ nodes are callable; a Python Function's node runs its backward through apply.
        call = node if callable(node) else node.apply
        grads = [received.get(i) for i in range(width)]
        for i, grad in enumerate(grads):  # a Function's missing gradients become zeros
            if grad is None and not callable(node) and metadata and i < len(metadata):
                grads[i] = torch.zeros(tuple(metadata[i].shape), dtype=metadata[i].dtype,
                                       device=metadata[i].device)
        outputs = call(*grads)
        clear = getattr(node, "maybe_clear_saved_tensors", None)
        if clear is not None:  # as the engine does without retain_graph: free what it saved
            clear()
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        edges = node.next_functions
        if len(outputs) != len(edges) and hasattr(node, "needs_input_grad"):
            # A Python Function returns one gradient per forward input, tensors or not; its
            # edges are its tensor inputs. The inputs needing a gradient are exactly the
            # edges with a node, in order.
            outputs = tuple(g for g, need in zip(outputs, node.needs_input_grad, strict=True)
                            if need)
            edges = tuple(e for e in edges if e[0] is not None)
        for (child, slot), grad in zip(edges, outputs, strict=False):
            if child is None:
                continue
            if grad is not None:
                pending = buffers.setdefault(child, {})
                pending[slot] = grad if slot not in pending else pending[slot] + grad
            incoming[child] -= 1
            if incoming[child] == 0:
                ready.append(child)
