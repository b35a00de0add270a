"""Parallelized modules refuse to lose a parameter: assigning, deleting or re-registering one
raises ``ModelChangedError`` naming it, since the compiled graphs read its shard, not the
attribute (``zeroc.sharding.sharded_params`` installs these methods on each module's class).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from zeroc.runtime.errors import ModelChangedError

__all__ = ["guard_methods"]


def _refuse(module: nn.Module, name: str, what: str, qualified: str) -> None:
    raise ModelChangedError(
        f"cannot {what} parameter {qualified!r} ({type(module).__name__}.{name}): the model "
        "was parallelized by zeroc and its compiled graphs read the parameter's shard, not "
        "the module attribute; change the values in place (with torch.no_grad(): "
        f"module.{name}.copy_(...)) or load a state dict, or build the changed model and "
        "call zeroc.parallelize on it"
    )


def guard_methods(cls: type, names: tuple[str, ...], qualified_name: Callable[[nn.Module, str], str]
                  ) -> dict[str, Callable[..., Any]]:
    """``__setattr__``, ``__delattr__`` and ``register_parameter`` for ``cls``'s parallelized
    subclass: each refuses to replace or remove one of the parameters ``names``, naming it
    by ``qualified_name(module, name)`` (its name in the model)."""
    guarded = frozenset(names)

    def __setattr__(self: nn.Module, name: str, value: Any) -> None:
        if name in guarded and value is not self.__dict__["_parameters"].get(name):
            _refuse(self, name, "assign", qualified_name(self, name))
        cls.__setattr__(self, name, value)

    def __delattr__(self: nn.Module, name: str) -> None:
        if name in guarded:
            _refuse(self, name, "delete", qualified_name(self, name))
        cls.__delattr__(self, name)

    def register_parameter(self: nn.Module, name: str, param: Any) -> None:
        if name in guarded and param is not self.__dict__["_parameters"].get(name):
            _refuse(self, name, "re-register", qualified_name(self, name))
        cls.register_parameter(self, name, param)

    return {"__setattr__": __setattr__, "__delattr__": __delattr__,
            "register_parameter": register_parameter}
