"""What the rules of this folder need before they are collected.

The suite's pytest plugin (``plugin/``: ``--driver``, the ``driver`` fixture, the time limits, the leak guard, the
summary) is loaded once per run. No entry point loads it into every pytest run of a machine: this file registers it
(``load_plugin``) where the rules are collected (``pytest conformance``, ``check-driver``), unless ``-p
extensible_kv_conformance.plugin`` (needed with ``--pyargs``, where pytest reads ``--driver`` before it finds this
file) registered a copy already. Either way its hooks run once.

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
