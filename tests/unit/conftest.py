"""Fixtures of the library tests that several files share (HumanEval, the sandbox's isolation mode)."""

from __future__ import annotations

import pytest

from verl_prm.code.data import read_humaneval
from verl_prm.code.sandbox import isolation


@pytest.fixture(scope="session")
def humaneval():
    return read_humaneval()


@pytest.fixture(scope="session")
def full_isolation() -> bool:
    return isolation().mode == "full"
