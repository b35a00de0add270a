"""CUDA tensors without a GPU, for planning: fake tensors on a ``cuda`` device, forward and
backward, on a CPU-only build of torch.

``FakeTensorMode`` makes tensors that carry a device, a shape and a dtype but no data; it
raises on any device mix, which is what the fake world checks. On a CUDA build of torch
``ensure_fake_cuda`` and ``fake_cuda_planning`` do nothing. On a CPU-only build two things
need CUDA, and ``ensure_fake_cuda`` supplies both from a few lines
of C++ built once with ``torch.utils.cpp_extension``:

- every op that opens a device guard (``mm``, ``linear``, ...) aborts the process ("PyTorch is
  not linked with support for cuda devices"). A CUDA device guard is registered (only where
  torch has none) that does nothing: one device, the default stream, events that are
  already complete.
- the autograd engine (``loss.backward()``, and ``torch.autograd.grad`` in AOTAutograd's
  joint trace) refuses CUDA tensors: ``Engine::execute`` gives ``InputBuffer::add`` the
  consumer node's stream, ``Node::stream()`` has none for a node when
  ``at::getAccelerator()`` finds no accelerator, and ``InputBuffer::add`` then asks
  ``at::accelerator::getCurrentStream``, whose ``getAccelerator(checked=true)`` raises
  "Cannot access accelerator device when none is available". ``getAccelerator`` takes CUDA
  to be the accelerator when the CUDA hooks say ``isBuilt()``. torch creates its CUDA hooks
  object once, at import, as a plain ``at::CUDAHooksInterface`` on this build; it is
  replaced in place by a subclass of the same size whose ``isBuilt()`` and
  ``hasPrimaryContext()`` (the engine's stream bookkeeping asks it) answer true while
  ``fake_cuda_planning`` is active, and give the base class's answers otherwise, so
  the rest of the process sees the torch it imported. Inside it the engine runs without
  its per-device threads (``torch.autograd.set_multithreading_enabled(False)``): the
  threads are sized once, by the first backward of the process, which may have run before
  the guard was registered.

A third thing differs without failing: ``scaled_dot_product_attention`` asks a dispatch stub
(``_fused_sdp_choice_stub``, not an operator) for its backend, and where no CUDA kernel is
registered it takes the math path, which saves a (batch, heads, seq, seq) score matrix per
layer where a GPU's fused kernels keep O(seq) per row. ``ensure_fake_cuda`` registers a CUDA
choice that, while ``fake_cuda_planning`` is active, picks what torch's own CUDA choice picks
on the planned GPU (an sm90 card: ``PLANNED_CAPABILITY``), in its default order, honouring
``torch.backends.cuda.enable_{flash,mem_efficient,math}_sdp`` and ``sdpa_kernel``: flash
attention (fp16/bf16, no attn_mask, causal only on square scores, equal head dims <= 256;
dropout and grouped KV heads allowed), else memory-efficient attention (fp32/fp16/bf16, any
mask, head dims divisible by 8 (4 for fp32), equal KV and query heads), else math. SDPA then
lowers to ``aten._scaled_dot_product_flash_attention`` or
``aten._scaled_dot_product_efficient_attention`` and their backward ops, which have fake
implementations, and ``torch.utils.flop_counter``'s formulas count their FLOPs. cuDNN
attention, which torch prefers on an sm90 card with a recent cuDNN, is not chosen: its
memory is the flash kernel's (output and one float per row). Nested inputs keep the math
path.

On a CUDA build with no GPU present the step's ``loss.backward()`` stays out of the engine
(whose stream bookkeeping for the gradients it hands to leaves keeps one entry per device
present, and there is none): ``run_backward`` walks the autograd graph itself there,
calling each node with its gradients in dependency order (calling an ``AccumulateGrad``
node sets ``.grad`` and runs the post-accumulate hooks, as the engine does).

Only the planning path (``zeroc.world.fake_world``) uses these; training never does.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ensure_fake_cuda", "fake_cuda_planning", "run_backward"]

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <atomic>
#include <new>
#include <string>
#include <typeinfo>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

Device cuda_device(Device device) {
  return Device(DeviceType::CUDA, device.index() < 0 ? 0 : device.index());
}

// One CUDA device with one stream; events are complete as soon as they are recorded.
struct FakeCudaGuard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device device) const override {
    return Stream(Stream::DEFAULT, cuda_device(device));
  }
  Stream getDefaultStream(Device device) const override { return getStream(device); }
  Stream getNewStream(Device device, int) const override { return getStream(device); }
  Stream exchangeStream(Stream stream) const override { return getStream(stream.device()); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
};

const FakeCudaGuard fake_cuda_guard;
std::atomic<bool> planning{false};

// torch's CUDA hooks on a CPU-only build, except while planning.
struct PlanningCudaHooks final : at::CUDAHooksInterface {
  bool isBuilt() const override {
    return planning.load() || at::CUDAHooksInterface::isBuilt();
  }
  bool hasPrimaryContext(DeviceIndex index) const override {
    return planning.load() || at::CUDAHooksInterface::hasPrimaryContext(index);
  }
};
static_assert(sizeof(PlanningCudaHooks) == sizeof(at::CUDAHooksInterface),
              "the hooks are replaced in place");
}  // namespace

bool install_cuda_guard() {
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(DeviceType::CUDA)];
  const c10::impl::DeviceGuardImplInterface* none = nullptr;
  return slot.compare_exchange_strong(none, &fake_cuda_guard);
}

std::string install_cuda_hooks() {
  auto* hooks = const_cast<at::CUDAHooksInterface*>(&at::detail::getCUDAHooks());
  if (dynamic_cast<PlanningCudaHooks*>(hooks) != nullptr) return "";
  if (typeid(*hooks) != typeid(at::CUDAHooksInterface)) return typeid(*hooks).name();
  hooks->~CUDAHooksInterface();
  new (hooks) PlanningCudaHooks();
  return "";
}

bool set_planning(bool on) { return planning.exchange(on); }
"""

# SDPA's backend on the planned GPU (see the module docstring). Outside planning the CUDA hooks
# say CUDA is not built and the choice is math, as it was with no CUDA kernel registered.
_SDPA_SOURCE = r"""
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <initializer_list>

namespace {
using sdp::SDPBackend;

bool planned_flash(const sdp::sdp_params& p) {
  if (!sdp::check_runtime_disabled_flash(p, false) || !sdp::check_tensor_shapes(p, false) ||
      !sdp::check_for_attn_mask(p, false)) {
    return false;
  }
  const auto dtype = p.query.scalar_type();
  const auto head = p.query.sym_size(-1);
  return (dtype == at::kHalf || dtype == at::kBFloat16) &&
         TORCH_GUARD_OR_FALSE(head.sym_eq(p.key.sym_size(-1))) &&
         TORCH_GUARD_OR_FALSE(head.sym_eq(p.value.sym_size(-1))) &&
         TORCH_GUARD_OR_FALSE(head.sym_le(256)) &&
         (!p.is_causal || TORCH_GUARD_OR_FALSE(p.query.sym_size(-2).sym_eq(p.key.sym_size(-2)))) &&
         sdp::check_batch_size_and_num_heads_dense<true>(p, false) &&
         sdp::check_nonzero_sequence_lengths_dense(p, false) &&
         sdp::check_last_dim_stride_equals_1_dense<true>(p, false);
}

bool planned_efficient(const sdp::sdp_params& p) {
  if (!sdp::check_runtime_disabled_mem_efficient(p, false) ||
      !sdp::check_tensor_shapes(p, false)) {
    return false;
  }
  const auto dtype = p.query.scalar_type();
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  const int64_t alignment = half ? 8 : 4;  // sm80 and on: a 128-bit tensor-core row
  const auto head = p.query.sym_size(-1);
  const auto head_v = p.value.sym_size(-1);
  if (!((half || dtype == at::kFloat) &&
        TORCH_GUARD_OR_FALSE(head.sym_eq(p.key.sym_size(-1))) &&
        TORCH_GUARD_OR_FALSE((head % alignment).sym_eq(0)) &&
        TORCH_GUARD_OR_FALSE(head.sym_gt(0)) &&
        TORCH_GUARD_OR_FALSE((head_v % alignment).sym_eq(0)) &&
        TORCH_GUARD_OR_FALSE(head_v.sym_gt(0)))) {
    return false;
  }
  for (const at::Tensor* t : {&p.query, &p.key, &p.value}) {  // the kernel's pointer alignment
    if (!TORCH_GUARD_OR_TRUE((t->sym_storage_offset() % alignment).sym_eq(0))) return false;
  }
  return sdp::check_nonzero_sequence_lengths_dense(p, false) &&
         sdp::check_last_dim_stride_equals_1_dense<false>(p, false) &&
         sdp::check_batch_size_and_num_heads_dense<false>(p, false);
}

int64_t planned_sdp_choice(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                           double dropout, bool is_causal, std::optional<double> scale,
                           bool enable_gqa) {
  const sdp::sdp_params p{query, key, value, attn_mask, dropout, is_causal, enable_gqa};
  if (!at::detail::getCUDAHooks().isBuilt() || !sdp::has_only_dense_inputs(p)) {
    return static_cast<int64_t>(SDPBackend::math);
  }
  if (planned_flash(p)) return static_cast<int64_t>(SDPBackend::flash_attention);
  if (planned_efficient(p)) return static_cast<int64_t>(SDPBackend::efficient_attention);
  TORCH_CHECK(at::globalContext().userEnabledMathSDP(),
              "zeroc planned CUDA world: no enabled scaled_dot_product_attention backend takes "
              "these inputs (flash and memory-efficient attention do not; math is disabled)");
  return static_cast<int64_t>(SDPBackend::math);
}
}  // namespace

// Only on a CPU-only torch, whose stub has no CUDA kernel (``is_device_supported`` is not
// callable from an extension: its signature depends on torch's CPU-capability macros).
void install_sdp_choice() {
  at::native::_fused_sdp_choice_stub.set_cuda_dispatch_ptr(&planned_sdp_choice);
}
"""
_LOCK = threading.Lock()
_MODULE: list[Any] = []  # the built extension, once ensure_fake_cuda has run on a CPU build


def _needed() -> bool:
    return not torch.backends.cuda.is_built()


def _build() -> Any:
    from torch.utils.cpp_extension import load_inline

    log.info("building the fake CUDA device guard and hooks for planning on a CPU-only torch")
    try:
        # Named by its source: processes of another zeroc version (a wheel being tested, an
        # older checkout) build their own and never rebuild or load this one under it.
        digest = hashlib.sha256((_SOURCE + _SDPA_SOURCE).encode()).hexdigest()[:12]
        return load_inline(f"zeroc_fake_cuda_{digest}", cpp_sources=[_SOURCE, _SDPA_SOURCE],
                           functions=["install_cuda_guard", "install_cuda_hooks",
                                      "set_planning", "install_sdp_choice"], verbose=False)
    except Exception as error:  # no compiler, no headers
        raise RuntimeError(
            "zeroc: planning for device='cuda' on a CPU-only torch needs a C++ compiler to "
            f"build a fake CUDA device guard, and building it failed: {error}. Plan with "
            "device='cpu', or install g++ (or a CUDA build of torch)") from None


def ensure_fake_cuda() -> None:
    """Make fake ``cuda`` tensors usable, forward and backward, inside
    ``fake_cuda_planning`` (a no-op where torch has CUDA)."""
    with _LOCK:
        if _MODULE or not _needed():
            return
        module = _build()
        if not module.install_cuda_guard():
            log.info("torch already has a CUDA device guard; planning uses it")
        unexpected = module.install_cuda_hooks()
        if unexpected:
            raise RuntimeError(
                "zeroc: planning for device='cuda' on this CPU-only torch needs its CUDA hooks "
                f"to be torch's own stubs, but they are {unexpected}. Plan with device='cpu' "
                "(or use a CUDA build of torch)")
        module.install_sdp_choice()
        _MODULE.append(module)


@contextlib.contextmanager
def fake_cuda_planning() -> Iterator[None]:
    """While active, the autograd engine takes CUDA fake tensors on a CPU-only torch (after
    ``ensure_fake_cuda``); on a CUDA build it changes nothing."""
    if not _MODULE:
        if _needed():
            raise RuntimeError("zeroc: fake_cuda_planning needs ensure_fake_cuda() first")
        yield
        return
    module = _MODULE[0]
    before = module.set_planning(True)
    try:
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or accelerator.type != "cuda":
            raise RuntimeError(
                "zeroc: planning for device='cuda' on this CPU-only torch needs torch to take "
                "CUDA as its accelerator when the CUDA hooks say they are built, and it took "
                f"{accelerator}. Plan with device='cpu' (or use a CUDA build of torch)")
        with torch.autograd.set_multithreading_enabled(False), _device_queries():
            yield
    finally:
        module.set_planning(before)


# The compute capability the planned GPU reports: ``torch.distributed.broadcast`` asks it of
# every CUDA tensor (FP8 handling), and a CPU-only torch has no device to ask.
PLANNED_CAPABILITY = (9, 0)


@contextlib.contextmanager
def _device_queries() -> Iterator[None]:
    """``torch.cuda.get_device_capability`` answers ``PLANNED_CAPABILITY`` (CPU-only torch)."""
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: PLANNED_CAPABILITY
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


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
