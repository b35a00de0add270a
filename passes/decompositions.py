"""The aten decompositions applied while tracing the joint graph.

Composite normalization, softmax and activation ops are split into pointwise ops and
last-dimension reductions so that the fusion pass can turn them into Triton kernels; matmuls,
convolutions and attention are kept whole (they stay aten). Where kernels run as aten ops
(CPU), nothing is decomposed: aten's own composite kernels are faster than their pieces.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._decomp import get_decompositions

aten = torch.ops.aten

DECOMPOSED_OPS = (
    aten.native_layer_norm,
    aten.native_layer_norm_backward,
    aten._softmax,
    aten._softmax_backward_data,
    aten._log_softmax,
    aten._log_softmax_backward_data,
    aten.gelu,
    aten.gelu_backward,
    aten.silu,
    aten.silu_backward,
    aten.sigmoid_backward,
    aten.tanh_backward,
    aten.threshold_backward,
    aten.mse_loss,
    aten.mse_loss_backward,
)


def decomposition_table(kernel_backend: str = "triton") -> dict[Any, Any]:
    """Map from aten op overloads to their Python decompositions for ``kernel_backend``
    (``"triton"`` or ``"aten"``, as ``zeroc.codegen.fused_kernel.choose_backend`` decides)."""
    if kernel_backend == "aten":
        return {}
    return get_decompositions(list(DECOMPOSED_OPS))
