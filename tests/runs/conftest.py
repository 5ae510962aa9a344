"""Run-directory tests: one torch thread, as in tests/trainer."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Every run-directory test on one torch thread (tests/conftest.py)."""
