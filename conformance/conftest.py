"""What the rules of this folder need before they are collected.

The suite's pytest plugin (``plugin/``: ``--driver``, the ``driver`` fixture, the leak guard, the summary) is loaded
once per run. Installed, pytest has loaded it through its ``pytest11`` entry point before any conftest, and this file
leaves it at that; in a source checkout that is not installed, this file registers it under the entry point's name
(``load_plugin``). Either way its hooks run once, also when an installed copy and a checkout's rules meet in one run.

The rules' Hypothesis profile is loaded here, so it applies where the rules run (not to every project that has the
package installed), unless ``--hypothesis-profile`` names another one.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

from . import load_plugin

PROFILE = "extensible-kv"  # registered by the plugin, with "extensible-kv-meta"


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    load_plugin(pluginmanager)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("hypothesis_profile", default=None) is None:
        settings.load_profile(PROFILE)
