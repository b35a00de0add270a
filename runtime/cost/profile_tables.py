"""A hardware profile's optional measured tables, checked: matmul FLOP/s by dtype and shape
class, collective fits by kind and group, and the note that says where they came from.

``HardwareProfile`` (``zeroc.runtime.cost.hardware``) runs ``check_tables`` when it is made;
``zeroc.runtime.cost.calibration`` measures tables of the same form.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from zeroc.runtime.errors import OptionError

if TYPE_CHECKING:
    from zeroc.runtime.cost.hardware import HardwareProfile

# The names the tables use (``zeroc.runtime.cost.hardware`` re-exports them).
FLOPS_DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8_e4m3fn",
                "float8_e5m2", "int8")
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "send", "recv")
SHAPE_CLASSES = ("small", "medium", "large")
_FIT_KEYS = {"latency_s", "bytes_per_s", "op"}
_GROUP_KEY = re.compile(r"[1-9][0-9]*:(intra|inter)")


def is_finite_number(value: Any) -> bool:
    """An int or float (not a bool) that is finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_tables(profile: HardwareProfile) -> None:
    """Check (and store as plain floats) ``profile``'s optional tables; a bad entry raises
    ``OptionError`` naming it, its value and what is allowed. Run by the profile itself."""
    where = f"hardware profile {profile.name!r}: key"
    table = profile.matmul_flops
    if table is not None:
        if not isinstance(table, Mapping):
            raise OptionError(f"{where} 'matmul_flops' = {table!r} must be a dict of dtype -> "
                              f"{{shape class: FLOP/s}}")
        for dtype, classes in table.items():
            if dtype not in FLOPS_DTYPES or not isinstance(classes, Mapping):
                raise OptionError(f"{where} 'matmul_flops[{dtype!r}]' = {classes!r}: the dtype "
                                  f"must be one of {', '.join(FLOPS_DTYPES)}, the value a dict")
            for name, value in classes.items():
                if name not in SHAPE_CLASSES or not is_finite_number(value) or value <= 0:
                    raise OptionError(f"{where} 'matmul_flops[{dtype!r}][{name!r}]' = {value!r}:"
                                      f" the class must be one of {', '.join(SHAPE_CLASSES)} "
                                      "and the FLOP/s > 0")
        object.__setattr__(profile, "matmul_flops", {
            d: {c: float(v) for c, v in classes.items()} for d, classes in table.items()})
    fits = profile.collectives
    if fits is not None:
        if not isinstance(fits, Mapping):
            raise OptionError(f"{where} 'collectives' = {fits!r} must be a dict of kind -> "
                              "{'<size>:intra' | '<size>:inter': fit}")
        for kind, groups in fits.items():
            if kind not in COLLECTIVE_KINDS or not isinstance(groups, Mapping):
                raise OptionError(f"{where} 'collectives[{kind!r}]' = {groups!r}: the kind must "
                                  f"be one of {', '.join(COLLECTIVE_KINDS)}, the value a dict")
            for group, fit in groups.items():
                name = f"{where} 'collectives[{kind!r}][{group!r}]' = {fit!r}"
                if not isinstance(group, str) or not _GROUP_KEY.fullmatch(group):
                    raise OptionError(f"{name}: the group must be '<size>:intra' or "
                                      "'<size>:inter', e.g. '8:intra'")
                if not isinstance(fit, Mapping) or set(fit) != _FIT_KEYS or not (
                        is_finite_number(fit["latency_s"]) and fit["latency_s"] >= 0
                        and is_finite_number(fit["bytes_per_s"]) and fit["bytes_per_s"] > 0
                        and isinstance(fit["op"], str) and fit["op"]):
                    raise OptionError(f"{name}: a fit is exactly {{'latency_s': >= 0, "
                                      "'bytes_per_s': > 0, 'op': a non-empty string}")
        object.__setattr__(profile, "collectives", {k: {g: {
            "latency_s": float(f["latency_s"]), "bytes_per_s": float(f["bytes_per_s"]),
            "op": f["op"]} for g, f in groups.items()} for k, groups in fits.items()})
    note = profile.collectives_note
    if note is not None and (not isinstance(note, str) or not note.strip()):
        raise OptionError(f"{where} 'collectives_note' = {note!r} must be a non-empty string "
                          "or absent")


# What a stored profile's figures may be (a file outside these is refused): FLOP/s up to
# 1e18, bandwidths up to 1e15 B/s, latencies up to a minute, a launch floor up to a second.
