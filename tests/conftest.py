"""Shared pytest setup: the model zoo on ``sys.path``, the backend under test, a clean Dynamo.

The zoo lives in ``tests/models`` and is imported as ``from models.gpt import GPT``.

Under ``pytest -n 3 --dist loadgroup`` (the README's command) every file's cases run on one
worker (one xdist group per file), so a file's module fixtures (a multi-rank harness, a
compiled model) are built once. xdist (3.6+) starts the files with the most cases first;
among equal counts, the files with the most slow cases. Multi-rank cases of several files may
run at once: their ranks spend much of a step waiting on each other (gloo, process start), so
the two cores are busier than when every multi-rank case runs one after another on one
worker.
``--compile-backend NAME`` runs the compile tests against another torch.compile backend
(e.g. ``aot_eager`` or ``inductor``) to tell a zeroc failure from a test or Dynamo problem.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
# The ranks the tests start fork from a server that has imported these once (``zeroc.cli.
# _rank_processes``): the HF model zoo and its helpers, then the suite's collector settings
# (``suite_gc``, last: it freezes what the others made); a missing one is skipped there.
os.environ.setdefault("ZEROC_RANK_PRELOAD", "transformers,models.hf,parity,suite_gc")

import suite_gc  # noqa: E402 - after the zoo is on sys.path


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register ``--compile-backend``."""
    parser.addoption(
        "--compile-backend",
        default="zeroc",
        help="torch.compile backend the parity and eager-semantics tests compile with "
        "(default: zeroc)",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One xdist group per file, the files with the most slow cases first in collection order
    (xdist then orders the groups by their number of cases, keeping this order among equals).
    Mixing the many single-process files with the few multi-rank ones keeps both cores busy:
    starting all multi-rank groups at once oversubscribes the cores and slows every rank."""
    slow: dict[str, int] = {}
    for item in items:
        key = os.fspath(item.path)
        slow[key] = slow.get(key, 0) + (1 if item.get_closest_marker("slow") else 0)
    order = {key: n for n, key in enumerate(dict.fromkeys(os.fspath(i.path) for i in items))}
    items.sort(key=lambda i: (-slow[os.fspath(i.path)], order[os.fspath(i.path)]))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(item.path.name))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what importing the test modules made (torch, transformers, zeroc, the zoo)."""
    suite_gc.apply()


@pytest.fixture
def compile_backend(request: pytest.FixtureRequest) -> str:
    """The backend name the compile tests pass to ``torch.compile(..., backend=...)``."""
    return request.config.getoption("--compile-backend")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Reset Dynamo's caches and counters around every test so no compile leaks between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
