"""zeroc's user-facing errors.

Dynamo wraps any exception a backend raises in ``BackendCompilerFailed`` (a RuntimeError),
except the ones derived from its ``ShortenTraceback``. ``passthrough`` re-types a zeroc error
so the user receives it as itself (e.g. a ``ValueError`` for a bad option) even when it is
raised while ``torch.compile`` compiles on the first call.
"""

from __future__ import annotations

from zeroc.runtime.errors import OptionError
from zeroc.runtime.torch_compat import ShortenTraceback  # None without it: errors arrive wrapped

__all__ = ["OptionError", "passthrough"]


_PASSTHROUGH: dict[type, type] = {}


def passthrough(error: Exception) -> Exception:
    """The same error, as an exception type Dynamo re-raises unwrapped."""
    if ShortenTraceback is None:
        return error
    cls = type(error)
    if cls not in _PASSTHROUGH:
        def __init__(self: Exception, message: str) -> None:
            ShortenTraceback.__init__(self, message, first_useful_frame=None)

        _PASSTHROUGH[cls] = type(cls.__name__, (ShortenTraceback, cls),
                                 {"__init__": __init__, "__module__": cls.__module__})
    return _PASSTHROUGH[cls](str(error))
