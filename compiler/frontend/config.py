"""The one validated, frozen Config that every part of zeroc reads.

``torch.compile(m, backend="zeroc", options={...})`` or ``mode=...`` reaches ``Config.build``.
Unknown keys and bad values raise ``OptionError`` (a ``ValueError``) naming the key, the
value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from zeroc.runtime.errors import OptionError

MODES = ("default", "max-autotune")
KERNEL_BACKENDS = ("auto", "triton", "aten", "inductor")
PARTITIONERS = ("min_cut", "default")
ACTIVATION_RECOMPUTE = ("auto", True, False)
# The pipeline schedules of zeroc.passes.program.schedule (kept here so the config stays
# import-light).
SCHEDULES = ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev")
# The largest values of the numeric options: a bucket of 1 TiB, a gather issued 4096 buckets
# ahead (past every bucket of any model), 65536 micro-batches a step.
MAX_BUCKET_MB = 1 << 20
MAX_PREFETCH = 4096
MAX_MICROBATCHES = 1 << 16
MAX_SECONDARY_SHARD = 1 << 16  # ranks in an hpZ group


@dataclasses.dataclass(frozen=True)
class Config:
    """Compile options. Every field is documented in README.md ("Options").

    kernels: "auto" compiles the graphs of CUDA tensors with Inductor and runs the fused
        groups' aten ops elsewhere; "inductor" always compiles every functional graph with
        Inductor (C++ kernels on CPU, Triton on CUDA) after zeroc's passes; "triton" always
        launches zeroc's own Triton kernels (on CPU needs TRITON_INTERPRET=1); "aten" never
        launches Triton (sources are still generated and shown in the plan).
    fusion: fuse pointwise chains and last-dimension reductions into kernels.
    fused_loss: compute a linear layer followed by cross-entropy (a language-model head) in
        row chunks with ``zeroc::linear_cross_entropy``, never materializing the logits.
        ``"auto"`` (default): on CUDA (its one-pass Triton chunk kernel), and elsewhere only
        where the logits are large (``rows x vocab x 4`` bytes at least 1/2048 of the device's
        memory), since on the CPU the chunked op costs time (about 6% of a small GPT's step)
        and saves memory that is not short; ``True`` / ``False``: always / never.
    partitioner: "min_cut" (recompute cheap ops, save less) or "default" (save what the
        forward computed) for splitting the joint graph into forward and backward.
    activation_recompute: with ``partitioner="min_cut"``, whether the backward recomputes
        cheap ops (GELU/SiLU-like activations, layer norms) whose inputs it keeps anyway
        instead of saving their outputs. ``"auto"`` (default): where a recomputed op fuses
        into the backward's kernels (Inductor, zeroc's Triton), not on the aten path (CPU by
        default), where each recomputed op is one more pass over its tensor; ``True`` /
        ``False``: always / never.
    kernel_autotune: for zeroc's own Triton kernels on a GPU: ``False`` (default) launches
        one default block configuration, untimed; ``True`` (set by mode="max-autotune") times
        the candidates at a kernel's first launch and persists the winner under
        ``<cache_dir>/autotune``, keyed by source, GPU name, dtypes and shape class (the
        power-of-two bucket of the problem size), so later runs reuse it untimed. Off a GPU
        the interpreter's fixed tile is used either way; the plan shows what was launched.
        On the Inductor path it is Inductor's ``max_autotune``.
    record_graphs: keep each pass's graph text before and after, for ``zeroc.explain``
        (``plan.passes_for(graph)[i].before`` / ``.after``). Off by default: rendering the
        texts costs about a fifth of a compile. The final text of every graph
        (``plan.graph(name).code``) is always kept.
    cache_dir: where generated kernel sources and autotune results are stored. zeroc
        creates its directories with mode 0o700 and refuses (OptionError) one that another
        user owns or that group or others can write; a cached file that is not exactly what
        zeroc generated is rewritten, never run.
    bucket_mb: ZeRO collectives pack parameters (gathers) or gradients (reductions) into
        buckets of at most this many MiB; one collective per bucket.
    prefetch: how many gather buckets ahead of their use a ZeRO-3 gather is issued (0: right
        before use, no overlap).
    gather_quant: ``None`` (default) or ``"int8"``: ZeRO-2/3 parameter all-gathers move int8
        values with a float32 scale per block of 256 (ZeRO++'s qwZ; 3.94x fewer bytes than
        float32); the receiver dequantizes into the gather dtype. The shards stay exact, only
        the gathered copy is lossy (``zeroc.runtime.quant.gather``). A model with no such
        gather (``zero`` 0 or 1) refuses it.
    reduce_quant: ``None`` (default), ``"int8"`` or ``"int4"``: ZeRO-1/2/3 gradient reductions
        send each rank's piece quantized blockwise (256 elements per float32 scale) by one
        all-to-all, dequantized and summed in float32 by the rank that keeps it (ZeRO++'s
        qgZ), with error feedback: each step's rounding error is added to the next step's
        gradient, at the cost of a float32 residual of the gradients on every rank
        (``zeroc.runtime.quant.reduce``). ``zero=0`` (all-reduce) refuses it, and so does a
        pipeline with ``pp_reshard=True``.
    secondary_shard: ``None`` (default) or ``k``: ZeRO++'s hpZ for ZeRO-3 at pp=1. Each
        rank keeps, from the forward's gather, its ``1/k`` piece of every weight (groups of
        ``k`` consecutive data-parallel ranks: a node), and the backward re-gathers the weights
        inside its group instead of over the whole data-parallel group
        (``zeroc.runtime.secondary_shard``); ``k`` must divide the data-parallel size and be
        smaller than it. Costs ``1/k`` of the weights (in the gather dtype) held from the
        forward to the backward.
    schedule: the pipeline schedule when the model was parallelized with pp > 1: one of
        ``SCHEDULES`` ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev").
    microbatches: micro-batches per step with pp > 1; ``None`` picks the number of stages, or
        the schedule's minimum when that is larger (dualpipe needs 2 * pp). Must divide the
        batch.
    split_points: with pp > 1, the modules that start stages 1, 2, ... (e.g. ``["layers.4"]``);
        ``None`` balances the stages by the cost model.
    loss_reduction: with pp > 1, how the micro-batches' losses combine: ``None`` proves it
        from the graph (sum, mean, mean over non-ignored targets; anything else is refused);
        ``"sum"``: the loss is a sum over samples; ``"mean"``: average the micro-batches'
        losses (exact only for equal-sized means).
    pp_reshard: with pp > 1 and ZeRO, ``False`` (default) gathers each stage's parameters
        once per step, before its first micro-batch, and reduces its gradients once, after
        its last backward (the full parameters and gradients of this rank's stages live for
        the step); ``True`` gathers and reduces inside every micro-batch's graphs (less
        memory, ``microbatches`` times the traffic). DualPipe(V)'s overlapped actions run,
        with ``False``, as the forward chunk, its sends, then the backward chunk (its
        transfers in flight while the other chunk computes); with ``True``, as one graph
        interleaving both chunks, so one chunk's collectives overlap the other's compute.
    unsplit_inputs: with pp > 1, the forward's tensor arguments passed whole to every
        micro-batch instead of cut along dimension 0 (every other tensor argument is part of
        the batch), e.g. ``["proj"]`` for a ``forward(x, proj, targets)`` whose ``proj`` is
        not batch-shaped.
    """

    mode: str = "default"
    kernels: str = "auto"
    fusion: bool = True
    fused_loss: str | bool = "auto"
    partitioner: str = "min_cut"
    activation_recompute: str | bool = "auto"
    kernel_autotune: bool = False
    record_graphs: bool = False
    cache_dir: str = "~/.cache/zeroc"
    bucket_mb: float = 25.0
    prefetch: int = 1
    gather_quant: str | None = None
    reduce_quant: str | None = None
    secondary_shard: int | None = None
    schedule: str = "1f1b"
    microbatches: int | None = None
    split_points: tuple[str, ...] | None = None
    loss_reduction: str | None = None
    pp_reshard: bool = False
    unsplit_inputs: tuple[str, ...] = ()

    @staticmethod
    def build(mode: str | None = None, options: Mapping[str, Any] | None = None) -> Config:
        """Validate ``mode`` and ``options`` and return the frozen Config."""
        mode = "default" if mode is None else mode
        if mode not in MODES:
            raise OptionError(f"zeroc: mode={mode!r} is not supported; allowed: {list(MODES)}")
        values: dict[str, Any] = {"mode": mode}
        if mode == "max-autotune":
            values["kernel_autotune"] = True
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise OptionError(f"zeroc: options must be a dict, got {type(options).__name__}")
        known = {f.name for f in dataclasses.fields(Config)} - {"mode"}
        for key, value in options.items():
            if key not in known:
                raise OptionError(
                    f"zeroc: unknown option {key!r} (value {value!r}); "
                    f"known options: {sorted(known)}"
                )
            values[key] = _check(key, value)
        return Config(**values)

    def to_dict(self) -> dict[str, Any]:
        """The options as a plain dict (for the plan)."""
        return dataclasses.asdict(self)

    @property
    def cache_path(self) -> str:
        """``cache_dir`` with ``~`` expanded."""
        return os.path.expanduser(self.cache_dir)


LOSS_REDUCTIONS = (None, "sum", "mean")
GATHER_QUANTS = (None, "int8")  # zeroc.runtime.quant.gather
REDUCE_QUANTS = (None, "int8", "int4")  # zeroc.runtime.quant.reduce
# The options only a pipeline (a model parallelized with pp > 1) reads. One options dict may
# serve pp=1 and pp>1 runs, so at pp=1 the backend warns once that they are ignored.
PIPELINE_OPTIONS = ("schedule", "microbatches", "split_points", "loss_reduction", "pp_reshard",
                    "unsplit_inputs")


def pipeline_options_in(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The pipeline-only options (``PIPELINE_OPTIONS``) given in ``options``, as given."""
    if not isinstance(options, Mapping):
        return {}
    return {key: options[key] for key in PIPELINE_OPTIONS if key in options}


def check_option(key: str, value: Any) -> Any:
    """``value`` as the Config holds it if it is allowed for option ``key``; raises
    ``OptionError`` naming the key, the value and what is allowed otherwise."""
    return _check(key, value)


def _check(key: str, value: Any) -> Any:
    """Return ``value`` if it is allowed for ``key``; raise ValueError otherwise."""
    choices = {"kernels": KERNEL_BACKENDS, "partitioner": PARTITIONERS,
               "gather_quant": GATHER_QUANTS, "reduce_quant": REDUCE_QUANTS}
    if key in choices:
        if value not in choices[key]:
            raise OptionError(
                f"zeroc: option {key}={value!r} is not allowed; allowed: {list(choices[key])}"
            )
        return value
    if key in ("activation_recompute", "fused_loss"):
        if not (value is True or value is False or value == "auto"):
            raise OptionError(f"zeroc: option {key}={value!r} is not allowed; "
                              "allowed: 'auto', True, False")
        return value
    if key in ("fusion", "kernel_autotune", "record_graphs", "pp_reshard"):
        if not isinstance(value, bool):
            raise OptionError(f"zeroc: option {key}={value!r} must be True or False")
        return value
    if key == "cache_dir":
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise OptionError(f"zeroc: option cache_dir={value!r} must be a non-empty path")
        return str(value)
    if key == "bucket_mb":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and 0 < value <= MAX_BUCKET_MB):
            raise OptionError(f"zeroc: option bucket_mb={value!r} must be a finite number of "
                              f"MiB in (0, {MAX_BUCKET_MB}]")
        return float(value)
    if key == "schedule":
        if value not in SCHEDULES:
            raise OptionError(
                f"zeroc: option schedule={value!r} is not a known schedule; "
                f"known: {list(SCHEDULES)}"
            )
        return value
    if key == "microbatches":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= MAX_MICROBATCHES):
            raise OptionError(f"zeroc: option microbatches={value!r} must be None or an "
                              f"integer in [1, {MAX_MICROBATCHES}]")
        return value
    if key == "split_points":
        if value is None:
            return None
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(
                isinstance(v, str) and v for v in value):
            raise OptionError(
                f"zeroc: option split_points={value!r} must be None or a list of module names "
                "such as ['layers.4']"
            )
        return tuple(value)
    if key == "unsplit_inputs":
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(
                isinstance(v, str) and v for v in value):
            raise OptionError(
                f"zeroc: option unsplit_inputs={value!r} must be a list of the forward's "
                "argument names, such as ['proj']")
        return tuple(value)
    if key == "loss_reduction":
        if value not in LOSS_REDUCTIONS:
            raise OptionError(f"zeroc: option loss_reduction={value!r} is not allowed; "
                              f"allowed: {list(LOSS_REDUCTIONS)}")
        return value
    if key == "secondary_shard":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 2 <= value <= MAX_SECONDARY_SHARD):
            raise OptionError(f"zeroc: option secondary_shard={value!r} must be None or the "
                              f"ranks of a group (a node), an integer in [2, "
                              f"{MAX_SECONDARY_SHARD}] dividing the data-parallel size")
        return value
    if key == "prefetch":
        if isinstance(value, bool) or not isinstance(value, int) or not (
                0 <= value <= MAX_PREFETCH):
            raise OptionError(f"zeroc: option prefetch={value!r} must be an integer in "
                              f"[0, {MAX_PREFETCH}]")
        return value
    raise AssertionError(f"option {key} has no check")
