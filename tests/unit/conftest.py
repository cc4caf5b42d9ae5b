"""Fixtures of the library tests that several files share (HumanEval)."""

from __future__ import annotations

import pytest

from verl_prm.code.data import read_humaneval


@pytest.fixture(scope="session")
def humaneval():
    return read_humaneval()
