"""Calling a Hydra entry point in the test's own process, as the error tests of tests/runs do."""

from __future__ import annotations

import sys

import pytest


def run_entry(monkeypatch, module, argv: list[str]) -> int:
    """Call the Hydra entry point `module.main` in this process with `argv`; its exit status."""
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    return exit_info.value.code


def must_not_run(*args, **kwargs):
    raise AssertionError("the stage started despite a bad setting")
