"""The suite's garbage-collector settings, for the pytest workers and the ranks they start.

Imported by ``tests/conftest.py`` in every pytest process and, last among the modules the
rank forkserver preloads (``ZEROC_RANK_PRELOAD``), in the forkserver, whose forked ranks
inherit both settings:

- the objects that exist once torch, transformers and zeroc are imported are frozen
  (``gc.freeze``): a full collection no longer walks the millions of objects of the imported
  modules, which never become garbage;
- the youngest generation is collected after 20,000 net allocations instead of 700: Dynamo,
  AOTAutograd and fake tensors allocate millions of short-lived objects per compile, and at
  700 the collector ran thousands of times per compile of a small Hugging Face model (10-15%
  of the compile's CPU time, measured on the MoE cases).

Nothing the tests check depends on when cyclic garbage is freed: the cases that count memory
count fake or device storages, which are freed by reference counting or an explicit
``gc.collect()``.
"""

from __future__ import annotations

import atexit
import gc

YOUNGEST_THRESHOLD = 20_000
OLDER_THRESHOLDS = (20, 20)


def apply() -> None:
    """Freeze what exists now and raise the collection thresholds (idempotent)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNGEST_THRESHOLD, *OLDER_THRESHOLDS)


# At exit the frozen objects go back to the collector, so the interpreter's teardown frees
# them as it would have (extension modules such as triton's report what was never freed).
atexit.register(gc.unfreeze)


apply()
