"""The callable that replaces a fused group of aten nodes in a graph.

A :class:`FusedKernel` holds the kernel IR, its generated Triton source and the group's
original aten ops as a small GraphModule. Called with the group's input tensors it returns the
group's outputs (one tensor, or a tuple), either by launching the Triton kernel or by running
the aten ops, which are correct by construction. Outputs are always fresh contiguous tensors,
whichever path runs, so the graph's fake metadata holds for both. While a ``torch.profiler``
records, each call runs inside ``record_function("zeroc/<kernel name>")``.
"""

from __future__ import annotations

import logging
import operator
import os

import torch
import torch.fx

from zeroc.codegen import autotune
from zeroc.codegen.compile_cache import load_kernel, source_hash
from zeroc.codegen.kernel_ir import KernelIR
from zeroc.runtime.errors import OptionError
from zeroc.runtime.executor import PROFILE_PREFIX, record
from zeroc.runtime.plan.plan import record_launch
from zeroc.runtime.plan.records import KernelInfo
from zeroc.runtime.torch_compat import FakeTensor, OpOverload

log = logging.getLogger(__name__)

KERNEL_BACKENDS = ("auto", "triton", "aten")


def interpreter_enabled() -> bool:
    """Whether Triton runs in interpreter mode (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def choose_backend(kernels: str, device: torch.device) -> str:
    """The path a kernel takes for the ``kernels`` option on ``device``.

    ``"auto"`` launches Triton on CUDA and runs aten elsewhere; ``"triton"`` always launches
    Triton and needs CUDA or ``TRITON_INTERPRET=1``; ``"aten"`` always runs aten.
    """
    if kernels not in KERNEL_BACKENDS:
        raise OptionError(f"option 'kernels' is {kernels!r}; allowed: "
                         f"{', '.join(repr(k) for k in KERNEL_BACKENDS)}")
    if kernels == "aten":
        return "aten"
    if kernels == "auto":
        return "triton" if device.type == "cuda" else "aten"
    if device.type != "cuda" and not interpreter_enabled():
        raise OptionError(f"option kernels='triton' needs a CUDA device, but the graph runs on "
                         f"{device.type!r}: set TRITON_INTERPRET=1 in the environment to run "
                         "Triton kernels on CPU (slow, for tests), or use kernels='auto'")
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise OptionError("option kernels='triton' needs the triton package, which cannot be "
                         f"imported ({exc}); use kernels='auto' or 'aten'") from exc
    return "triton"


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor) or t.device.type == "meta"


def _may_alias_an_input(node: object) -> bool:
    """Whether the graph value ``node`` may share storage with a graph input: it is one, or a
    view of one (an op whose schema says its result aliases an argument). Anything that is
    not an aten op is assumed to alias."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op != "call_function":  # a placeholder is an input; anything else may alias
        return True
    if node.target is operator.getitem:
        return _may_alias_an_input(node.args[0])
    if not isinstance(node.target, OpOverload):
        return True
    if all(r.alias_info is None for r in node.target._schema.returns):
        return False  # a fresh result, whatever it reads
    return any(_may_alias_an_input(arg) for arg in node.all_input_nodes)


def aliasing_outputs(graph: torch.fx.GraphModule) -> tuple[int, ...]:
    """Indices of ``graph``'s outputs that may share storage with one of its inputs."""
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    values = output.args[0]
    values = values if isinstance(values, (tuple, list)) else (values,)
    return tuple(i for i, value in enumerate(values) if _may_alias_an_input(value))


class FusedKernel:
    """A fused group: ``kernel(*inputs)`` returns its outputs (tuple when several).

    ``backend`` is ``"triton"`` or ``"aten"`` (see :func:`choose_backend`). ``aten_graph``
    computes the same outputs from the same inputs with the original aten ops; it also runs
    for fake tensors (shape propagation) and for tensors on a device Triton cannot use.
    ``tune`` is the ``kernel_autotune`` option; ``info`` the kernel's plan record, set by
    the fusion pass, which gets the launched configuration after the first launch.
    """

    def __init__(self, ir: KernelIR, source: str, aten_graph: torch.fx.GraphModule,
                 backend: str, cache_dir: str | None, tune: bool = False) -> None:
        self.ir = ir
        self.source = source
        self.source_hash = source_hash(source)
        # How the step estimate's op timing names this kernel (``zeroc.runtime.cost.op_timing``).
        self.timing_key = f"zeroc.kernel_{self.source_hash[:16]}.{backend}"
        self.aten_graph = aten_graph
        # The generated function itself: nn.Module's call machinery costs more per call than
        # the group's small aten ops on CPU, and a kernel has no hooks to run.
        self._run_graph = aten_graph.forward
        self._aliasing = aliasing_outputs(aten_graph)
        self.backend = backend
        self.cache_dir = cache_dir
        self.__name__ = ir.name
        self.__qualname__ = ir.name
        self.profile_name = PROFILE_PREFIX + ir.name
        self.tune = tune
        self.info: KernelInfo | None = None
        self._config: autotune.LaunchConfig | None = None

    def __repr__(self) -> str:
        return f"FusedKernel({self.ir.name}, {self.ir.kind}, backend={self.backend})"

    def __deepcopy__(self, memo: dict) -> FusedKernel:
        return self

    def __call__(self, *inputs: torch.Tensor):
        with record(self.profile_name):
            if self.backend == "triton" and self._can_launch(inputs):
                outputs = self.launch(inputs)
            else:
                outputs = self.run_aten(inputs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _can_launch(self, inputs: tuple[torch.Tensor, ...]) -> bool:
        if any(_is_fake(t) for t in inputs):
            return False
        device = inputs[0].device
        return device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())

    def run_aten(self, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The group's outputs computed by its original aten ops."""
        result = self._run_graph(*inputs)
        outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        # A kernel's outputs are fresh tensors: an output that is an input or shares an
        # input's storage is cloned. Only outputs that the graph can make as views of its
        # inputs are checked (``aliasing_outputs``), the inputs' storages read once per call.
        if self._aliasing:
            given = {id(t) for t in inputs}
            storages = {t.untyped_storage().data_ptr() for t in inputs if not _is_fake(t)}
            for index in self._aliasing:
                out = outputs[index]
                if id(out) in given or (storages and not _is_fake(out)
                                        and out.untyped_storage().data_ptr() in storages):
                    outputs[index] = out.clone(memory_format=torch.contiguous_format)
        return [out.contiguous() for out in outputs]

    def launch(self, inputs: tuple[torch.Tensor, ...],
               config: autotune.LaunchConfig | None = None) -> list[torch.Tensor]:
        """Run the Triton kernel (autotuning the launch on first GPU call)."""
        args = [t.contiguous() for t in inputs]
        device = args[0].device
        if config is None:
            config = self._pick_config(args)
        outputs = [torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
                   for spec in self.ir.outputs]
        self._run(args, outputs, config)
        return outputs

    def _run(self, args: list[torch.Tensor], outputs: list[torch.Tensor],
             config: autotune.LaunchConfig) -> None:
        fn = load_kernel(self.source, self.ir.name, self.cache_dir)
        size = self.ir.numel if self.ir.kind == "pointwise" else self.ir.rows
        fn[autotune.grid(self.ir, config)](*args, *outputs, size, self.ir.cols,
                                           num_warps=config.num_warps, **config.as_kwargs())

    def _pick_config(self, args: list[torch.Tensor]) -> autotune.LaunchConfig:
        if self._config is not None:
            return self._config
        device = args[0].device
        key = (autotune.tune_key(self.ir, self.source_hash, device)
               if self.tune and autotune.is_gpu(device) else None)
        scratch: list[torch.Tensor] = []  # outputs of the timed launches, made if tuning

        def trial(config: autotune.LaunchConfig) -> None:
            if not scratch:
                scratch.extend(torch.empty(spec.shape, dtype=getattr(torch, spec.dtype),
                                           device=device) for spec in self.ir.outputs)
            self._run(args, scratch, config)

        self._config = autotune.choose_config(self.ir, device, self.tune, key, self.cache_dir,
                                              trial)
        log.debug("zeroc: kernel %s launches with %s%s", self.ir.name, self._config.to_json(),
                  " (tuned)" if key is not None else "")
        if self.info is not None:
            record_launch(self.info, tuple(self._config.to_json().items()))
        return self._config

    def planned_config(self, device: torch.device) -> autotune.LaunchConfig:
        """The configuration the first launch on ``device`` is expected to use, for the plan
        before any launch: the launched one once there was a launch; else the persisted winner
        when tuning and one exists (read, never timed); else the default for the device."""
        if self._config is not None:
            return self._config
        on_gpu = autotune.is_gpu(device)
        if on_gpu and self.tune and torch.cuda.is_available():
            key = autotune.tune_key(self.ir, self.source_hash, device)
            tuned = autotune.load_tuned(self.cache_dir, key, self.ir)
            if tuned is not None:
                return tuned
        return autotune.default_config(self.ir, on_gpu)
