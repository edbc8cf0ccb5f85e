"""The project's own tests take the suite's options too (``--driver``, the Hypothesis profiles): its plugin is
registered here as well as in ``conformance/conftest.py`` (once per run either way), so a run of ``tests/`` alone
accepts the same command line as a run that includes the rules."""

from __future__ import annotations

import pytest

from conformance import load_plugin


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    load_plugin(pluginmanager)
