"""The one seam for torch internals: every private torch name zeroc uses, and every version shim.

zeroc relies on parts of torch that torch does not promise to keep: fake tensors, dispatch
modes, pytree, Dynamo's and AOTAutograd's entry points, Inductor, a few C++ bindings used as
FX targets. Each is imported here, once, under a plain name, and every other module imports
it from here (``tests/test_torch_seam.py`` fails on a private torch module or attribute of a
torch module used anywhere else). A torch upgrade that moves one of them is fixed in this
file. Where torch has a public API (``torch.compiler.reset``, ``torch.compiler.disable``,
``torch.compiler.assume_constant_result``, ``torch.nn.functional.linear``,
``torch.nn.utils.get_total_norm``), the other modules call it directly instead.

Supported: torch 2.11 to 2.13. A name torch may lack is looked up with a fallback here
(``all_gather_single`` is new in 2.13; ``ShortenTraceback`` is ``None`` without it).

Heavy or rarely needed modules (AOTAutograd, Inductor, the fake process group's store, the
DTensor spec) are imported on first use: ``from zeroc.runtime.torch_compat import
compile_fx_inner`` inside a function imports Inductor then, not when this module loads, and
reads the name from torch each time (a test's monkeypatch of torch's module is seen).

Private attributes of torch objects (not modules) stay where they are used; the ones that
have changed across torch versions, or may:

- ``DTensor._local_tensor`` (``compiler/fake_world``, ``compiler/stage_holding``,
  ``compiler/deferred_init``): the local shard, read and replaced in place;
- ``OpOverload._schema``, ``._opname``, ``._overloadname`` and
  ``OpOverloadPacket._qualified_op_name`` (``passes/dead_code``,
  ``passes/activation_recompute``, ``compiler/meta_skeleton``, ``compiler/pipeline_front``,
  ``runtime/op_timing``, ``codegen/inductor_graphs``);
- ``UntypedStorage._cdata`` (a storage's identity: ``runtime/fake_replay``,
  ``runtime/pipeline/executor``, ``compiler/model_profile``, ``compiler/meta_skeleton``);
- ``Tensor._base`` and ``Tensor._is_view()`` (``runtime/fake_replay``,
  ``passes/front/split_stages``);
- ``Module._parameters``, ``._buffers``, ``._modules``, ``._forward_hooks``,
  ``._forward_pre_hooks`` and ``Module._save_to_state_dict`` (``compiler/plan_capture``,
  ``compiler/model_profile``, ``compiler/meta_skeleton``, ``compiler/sharded_params``);
- ``ProcessGroup._get_backend(device)`` (``runtime/collectives``);
- ``GraphModule`` graph's ``_codegen`` (``passes/decompositions``).

Operator names under ``torch.ops`` (``torch.ops._c10d_functional``,
``aten._softmax_backward_data``) are registered names, not Python modules, and are used
where they are needed.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as _clip_grad
from torch._decomp import get_decompositions
from torch._guards import detect_fake_mode, tracing
from torch._ops import OpOverload, OpOverloadPacket
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
from torch.utils._pytree import (
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
)

if TYPE_CHECKING:  # the names ``__getattr__`` imports on first use (below)
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    from torch._dynamo import maybe_mark_dynamic
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.exc import ShortenTraceback, SkipFrame
    from torch._functorch.aot_autograd import aot_export_joint_simple
    from torch._functorch.partitioners import (
        default_partition,
        min_cut_rematerialization_partition,
    )
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = [
    # fake tensors and dispatch modes
    "FakeTensor", "FakeTensorMode", "TorchDispatchMode", "detect_fake_mode",
    "disable_current_modes", "is_traceable_wrapper_subclass", "make_contiguous_strides_for",
    "tracing", "unset_fake_temporarily",
    # FX graphs: op types, pytree, graph-module class, decompositions, call targets
    "ENTER_AUTOCAST", "EXIT_AUTOCAST", "LazyGraphModule", "OpOverload", "OpOverloadPacket",
    "SET_GRAD_ENABLED", "get_decompositions", "keystr", "tree_flatten",
    "tree_flatten_with_path", "tree_leaves", "tree_map",
    # eager helpers
    "clip_total_norm", "foreach_mul_", "profiler_enabled", "set_clip_total_norm",
    # Dynamo, AOTAutograd, Inductor
    "ShortenTraceback", "SkipFrame", "aot_autograd", "aot_export_joint_simple",
    "compile_fx_inner", "current_translator", "default_partition", "dynamo_config",
    "graph_break_reasons", "inductor_config", "maybe_mark_dynamic",
    "min_cut_rematerialization_partition", "preload_inductor_pattern_matcher",
    "select_decomp_table",
    # torch's logging registry
    "add_torch_log_handler", "register_torch_log", "torch_logs_env_var",
    # torch.distributed
    "DTensorSpec", "FakeStore", "TensorMeta", "all_gather_single", "dcp_flat_keys",
    "default_store",
    "reduce_scatter_single", "resolve_process_group",
]

# --- FX call targets -------------------------------------------------------------------------

# ``with torch.no_grad():`` in a Dynamo or AOTAutograd graph: calls of this function.
SET_GRAD_ENABLED: Callable[[bool], None] = torch._C._set_grad_enabled
# ``with torch.autocast(...)`` in a Dynamo graph: calls of these two.
ENTER_AUTOCAST: Callable[..., Any] = torch.amp.autocast_mode._enter_autocast
EXIT_AUTOCAST: Callable[..., Any] = torch.amp.autocast_mode._exit_autocast

# --- eager helpers ---------------------------------------------------------------------------

# In-place multiply of a list of tensors by a scalar or tensor, one kernel per device and dtype.
foreach_mul_: Callable[..., Any] = torch._foreach_mul_
# Whether a torch profiler records now (cheap: read on every graph call).
profiler_enabled: Callable[[], bool] = torch._C._autograd._profiler_enabled


def clip_total_norm() -> Callable[..., torch.Tensor]:
    """The norm function ``torch.nn.utils.clip_grad_norm_`` and ``get_total_norm`` call now
    (torch 2.6 on: ``torch.nn.utils.clip_grad._get_total_norm``)."""
    return _clip_grad._get_total_norm


def set_clip_total_norm(fn: Callable[..., torch.Tensor]) -> None:
    """Make ``clip_grad_norm_`` compute its norm with ``fn`` (see ``clip_total_norm``)."""
    _clip_grad._get_total_norm = fn


# --- Dynamo ----------------------------------------------------------------------------------


def graph_break_reasons() -> list[Any]:
    """The graph breaks Dynamo recorded since its last reset, oldest first (empty if none)."""
    from torch._dynamo import utils

    return list(getattr(utils, "graph_break_reasons", None) or ())


def current_translator() -> Any | None:
    """Dynamo's instruction translator of the frame it is compiling now; ``None`` outside a
    compile. Its ``output.compiler_fn`` is the backend the ``torch.compile`` call gave."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx()
    except AttributeError:  # no frame is being translated
        return None


def preload_inductor_pattern_matcher() -> None:
    """Import Inductor's pattern matcher (the min-cut partitioner's CSE loads it: seconds)."""
    importlib.import_module("torch._inductor.pattern_matcher")


# --- torch's logging registry (imported when called: it may run while torch is importing) ---


def register_torch_log(setting: str, logger_name: str) -> None:
    """Register ``logger_name`` under ``TORCH_LOGS=<setting>`` (``torch._logging``). Raises
    AttributeError or TypeError where torch's registry differs."""
    from torch._logging import _internal

    _internal.register_log(setting, logger_name)


def torch_logs_env_var() -> str:
    """The environment variable torch reads its log settings from."""
    from torch._logging import _internal

    return getattr(_internal, "LOG_ENV_VAR", "TORCH_LOGS")


def add_torch_log_handler(logger: logging.Logger) -> None:
    """Give ``logger`` torch's log handler, as ``TORCH_LOGS`` does at import, unless it has it."""
    from torch._logging import _internal

    is_torch_handler = getattr(_internal, "_is_torch_handler", lambda handler: False)
    if not any(is_torch_handler(h) for h in logger.handlers):
        _internal._setup_handlers(logging.StreamHandler, logger)


# --- torch.distributed -----------------------------------------------------------------------

# torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor for these names; 2.11
# has only the former. Same arguments.
all_gather_single: Callable[..., Any] | None = (
    getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None))
reduce_scatter_single: Callable[..., Any] | None = (
    getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None))


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` (the name functional collectives
    take). Raises where no group has that name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def dcp_flat_keys(state: dict[str, Any]) -> set[str]:
    """The keys ``torch.distributed.checkpoint`` gives ``state``'s entries (what ``dcp.save``
    writes and ``dcp.load`` reads): its own flattening, so the two always agree."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return set(flatten_state_dict(state)[0])


def default_store() -> dist.Store | None:
    """The store of the default process group (the job's rendezvous store), or ``None``."""
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


# --- imported on first use -------------------------------------------------------------------

# name -> (module, attribute in it; None: the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "ShortenTraceback": ("torch._dynamo.exc", "ShortenTraceback"),
    # Raised while Dynamo traces a frame: it runs that frame eagerly instead of compiling it.
    "SkipFrame": ("torch._dynamo.exc", "SkipFrame"),
    "dynamo_config": ("torch._dynamo.config", None),
    "maybe_mark_dynamic": ("torch._dynamo", "maybe_mark_dynamic"),
    "aot_autograd": ("torch._dynamo.backends.common", "aot_autograd"),
    "aot_export_joint_simple": ("torch._functorch.aot_autograd", "aot_export_joint_simple"),
    "default_partition": ("torch._functorch.partitioners", "default_partition"),
    "min_cut_rematerialization_partition": (
        "torch._functorch.partitioners", "min_cut_rematerialization_partition"),
    "inductor_config": ("torch._inductor.config", None),
    "select_decomp_table": ("torch._inductor.decomposition", "select_decomp_table"),
    "compile_fx_inner": ("torch._inductor.compile_fx", "compile_fx_inner"),
    "FakeStore": ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    "DTensorSpec": ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    "TensorMeta": ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
}
# Names that are None on a torch without them, instead of raising.
_OPTIONAL = {"ShortenTraceback"}


def __getattr__(name: str) -> Any:
    """The names of ``_LAZY``, imported now (and read from torch on every call)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    try:
        module = importlib.import_module(module_name)
        return module if attribute is None else getattr(module, attribute)
    except (ImportError, AttributeError):
        if name in _OPTIONAL:
            return None
        raise
