"""Shared pytest setup: the model zoo on ``sys.path``, the backend under test, a clean Dynamo.

The zoo lives in ``tests/models`` and is imported as ``from models.gpt import GPT``.

Under ``pytest -n 2 --dist loadgroup`` (the README's command) the slow cases of the files that
start ranks (``run_ranks``, ``torchrun``) run one after another on one worker while the other
worker takes every other case file by file: two multi-rank cases never share the two cores,
and a file's module fixtures are built once per worker that runs its cases.
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


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register ``--compile-backend``."""
    parser.addoption(
        "--compile-backend",
        default="zeroc",
        help="torch.compile backend the parity and eager-semantics tests compile with "
        "(default: zeroc)",
    )


_STARTS_RANKS = ("run_ranks(", "torchrun", "start_processes(")


def _starts_ranks(path: os.PathLike[str], seen: dict[str, bool]) -> bool:
    """Whether a test file starts several processes of its own."""
    key = os.fspath(path)
    if key not in seen:
        with open(key, encoding="utf-8") as source:
            text = source.read()
        seen[key] = any(token in text for token in _STARTS_RANKS)
    return seen[key]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One xdist group for the slow cases of files that start ranks, one per file for the
    rest."""
    seen: dict[str, bool] = {}
    for item in items:
        ranks = item.get_closest_marker("slow") and _starts_ranks(item.path, seen)
        item.add_marker(pytest.mark.xdist_group("ranks" if ranks else item.path.name))


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
