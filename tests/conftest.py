"""The project's own tests take the suite's options too (``--driver``, the Hypothesis profiles): its plugin is
registered here as well as in ``conformance/conftest.py`` (once per run either way), so a run of ``tests/`` alone
accepts the same command line as a run that includes the rules."""

from __future__ import annotations

import pytest

from conformance import load_plugin
from extensible_kv.reaper import inside_section


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    load_plugin(pluginmanager)


@pytest.fixture(autouse=True)
def _no_section_left_held():
    """A test must not leave this thread inside a ``reaper.busy()`` section: every later sweep of the process would be
    put off for good, and tests far from the cause (any that collects a tensor) would fail instead of this one. A broken
    driver interrupted as it leaves a multi-line ``with busy():`` does this (Note [Locked sections are one line])."""
    yield
    assert not inside_section(), "the test left this thread inside a reaper.busy() section: later sweeps are put off"
