"""Shared pytest setup: the model zoo on ``sys.path``, the backend under test, a clean Dynamo.

The zoo lives in ``tests/models`` and is imported as ``from models.gpt import GPT``.
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
