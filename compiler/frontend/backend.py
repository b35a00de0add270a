"""The ``zeroc`` torch.compile backend.

Registered only through the ``torch_dynamo_backends`` entry point (see pyproject.toml), so
``torch.compile(model, backend="zeroc")`` works without ``import zeroc``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch.fx

from zeroc.errors import OptionError, passthrough
from zeroc.frontend.capture import compile_dynamo_graph, source_name
from zeroc.frontend.config import Config, pipeline_options_in
from zeroc.frontend.grad_coverage import MissingGradientError
from zeroc.frontend.model_changes import (
    ModelChangedError,
    check_graph_parameters,
    watch_requires_grad,
)
from zeroc.frontend.session import find_compile_wrapper, session_for
from zeroc.pipeline.pipeline_capture import PipelineError, compile_pipeline, pipeline_layout_of
from zeroc.runtime.consistency import PlanMismatchError
from zeroc.runtime.shutdown import drop_captured_groups

log = logging.getLogger(__name__)


def zeroc_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """Compile one Dynamo graph with zeroc.

    ``mode`` and ``options`` are what the user passed to ``torch.compile``; they are
    validated into one frozen :class:`zeroc.frontend.config.Config` (``ValueError`` on bad input).
    """
    # torch.compile imported torch._dynamo (and with it torch.distributed.nn) just now, maybe
    # after init_process_group: do not let those imports keep the default group alive.
    drop_captured_groups()
    try:
        config = Config.build(mode, _with_tuned_options(example_inputs, options))
        check_layout_options(example_inputs, config)
        session = session_for(find_compile_wrapper(), config)
        # A parameter added after parallelize, or an unseen requires_grad change: see there.
        check_graph_parameters([source_name(n) for n in gm.graph.find_nodes(op="placeholder")],
                               example_inputs)
        layout = pipeline_layout_of(example_inputs)
        log.debug("zeroc: backend: %s, %s", "a pipeline" if layout is not None else
                  "one graph", config)
        if layout is not None:
            compiled = compile_pipeline(gm, example_inputs, config, session, layout)
        else:
            _warn_unused_pipeline_options(example_inputs, options)
            compiled = compile_dynamo_graph(gm, example_inputs, config, session)
        return watch_requires_grad(compiled, example_inputs)
    except (OptionError, PipelineError, PlanMismatchError, MissingGradientError,
            ModelChangedError) as error:
        raise passthrough(error) from None


def _with_tuned_options(example_inputs: list[Any], options: Mapping[str, Any] | None
                        ) -> Mapping[str, Any] | None:
    """``options`` over the tuned ones of a ``parallelize(layout="auto")`` model: the
    tuner's choices are the defaults, what the user passed wins. They apply only where the
    model is compiled with inputs of the shapes they were tuned for, and never hold an option
    that changes what is computed (``zeroc.sharding.tune_cache.tuned_options_for``)."""
    from zeroc.sharding.tune_cache import tuned_options_for

    layout = next((v._zeroc_layout for v in example_inputs
                   if hasattr(v, "_zeroc_layout")), None)
    tuned = tuned_options_for(layout, example_inputs)
    if not tuned:
        return options
    return {**dict(tuned), **dict(options or {})}


def check_layout_options(example_inputs: list[Any], config: Config) -> None:
    """Refuse the options that need a model parallelized a certain way (quantized
    collectives, hpZ) when the compiled graph's model is not: they would change nothing."""
    _check_quantization(example_inputs, config)
    _check_secondary_shard(example_inputs, config)


def _check_quantization(example_inputs: list[Any], config: Config) -> None:
    """Refuse ``gather_quant`` / ``reduce_quant`` for a model whose graphs run no such
    collective, and ``reduce_quant`` where its error feedback could not be kept per stage."""
    asked = {k: v for k, v in (("gather_quant", config.gather_quant),
                               ("reduce_quant", config.reduce_quant)) if v is not None}
    if not asked or not any(isinstance(v, torch.nn.Parameter) for v in example_inputs):
        return  # a graph without parameters (e.g. a graph break's tail) tells nothing
    layout = next((v._zeroc_layout for v in example_inputs
                   if hasattr(v, "_zeroc_layout")), None)
    needs = {"gather_quant": (2, "the parameter all-gathers of ZeRO-2 and ZeRO-3"),
             "reduce_quant": (1, "the gradient reduce-scatters of ZeRO-1, 2 and 3")}
    for key, value in asked.items():
        least, what = needs[key]
        if layout is not None and layout.zero >= least:
            continue
        model = ("was not parallelized" if layout is None else
                 f"was parallelized with zero={layout.zero}, which runs none")
        raise OptionError(
            f"zeroc: option {key}={value!r} quantizes {what}, and this model {model}, so "
            f"nothing would be quantized; parallelize with zeroc.parallelize(model, "
            f"zero={max(least, 2)}) or higher, or leave the option out")
    if "reduce_quant" in asked and layout.pp > 1 and config.pp_reshard:
        raise OptionError(
            f"zeroc: option reduce_quant={config.reduce_quant!r} is supported in pipelines "
            "with pp_reshard=False (the default: gradients reduced once per step), not with "
            "pp_reshard=True, whose stage graphs may be shared between stages and so cannot "
            "keep each stage's error-feedback residual")


def _check_secondary_shard(example_inputs: list[Any], config: Config) -> None:
    """Refuse ``secondary_shard`` (hpZ) where the backward re-gathers no weight over a
    data-parallel group it can split: only ZeRO-3 at pp=1 does, over ``dp`` ranks that
    ``k`` divides."""
    k = config.secondary_shard
    if k is None or not any(isinstance(v, torch.nn.Parameter) for v in example_inputs):
        return
    layout = next((v._zeroc_layout for v in example_inputs
                   if hasattr(v, "_zeroc_layout")), None)
    where = ("this model was not parallelized" if layout is None else
             f"this model was parallelized with zero={layout.zero}, pp={layout.pp}")
    if layout is None or layout.zero != 3 or layout.pp != 1:
        raise OptionError(
            f"zeroc: option secondary_shard={k!r} splits the backward's re-gathers of ZeRO-3 "
            f"at pp=1 (a pipeline gathers each stage's weights once per step), and {where}; "
            "parallelize with zeroc.parallelize(model, zero=3) or leave the option out")
    if layout.dp % k or k >= layout.dp:
        allowed = [d for d in range(2, layout.dp) if layout.dp % d == 0]
        raise OptionError(
            f"zeroc: option secondary_shard={k!r} must divide the data-parallel size "
            f"{layout.dp} and be smaller than it (allowed: {allowed or 'none'}): the "
            "backward re-gathers inside groups of that many ranks")


_WARNED: set[str] = set()


def _warn_unused_pipeline_options(example_inputs: list[Any],
                                  options: Mapping[str, Any] | None) -> None:
    """Warn once per process and set of options that pipeline options go unused at pp=1.

    Only here is pp known (``torch.compile`` takes the options before it sees the model): a
    graph whose parameters carry no pipeline layout belongs to a pp=1 (or unparallelized)
    model. A graph without parameters (e.g. a graph break's tail) tells nothing and is skipped.
    """
    given = pipeline_options_in(options)
    if not given or not any(isinstance(v, torch.nn.Parameter) for v in example_inputs):
        return
    listed = ", ".join(f"{key}={value!r}" for key, value in given.items())
    message = (
        f"zeroc: options {listed} apply only to pipelines, and this model was parallelized "
        "with pp=1 (or not parallelized), so they are ignored; pass pp >= 2 to "
        "zeroc.parallelize to pipeline it, or leave them out of the options of pp=1 runs"
    )
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=1)
