"""The application tests (recipe, demo, benchmarks, the ``verl-prm`` dispatcher, the docs) are all marked
``slow``: ``python -m pytest -m "not slow"`` runs the library's and the glue's quick tests alone."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):  # noqa: ARG001  (pytest hook signature)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)
