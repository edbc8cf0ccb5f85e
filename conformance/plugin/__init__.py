"""The conformance suite's pytest plugin, one job per module:

- ``selection``: ``--driver``, which drivers the rules run on, the ``driver`` fixture, the report header;
- ``leaks``: the leak guard the ``driver`` fixture runs after each rule;
- ``watchdog``: ``--build-timeout`` and ``--rule-timeout`` in pytest-xdist workers;
- ``summary``: each rule's outcome per driver, and the end-of-run table and ``--summary-json``;
- ``outcomes``: a driver that raises pytest's own outcomes (skip, xfail, exit) fails the rule it ran in.

No entry point loads it into every pytest run: the rules' ``conftest.py`` registers it under ``NAME``, and elsewhere
``-p extensible_kv_conformance.plugin`` names it. In a run that does not ask for the rules it stays out of the way:
only a test that takes its ``driver`` fixture is parametrized over drivers, and the header and the GPU check speak
only when ``--driver`` is given or the rules' folder is among the paths. Its state lives in ``pytest.StashKey``s on the
config, never in module globals.
"""

from __future__ import annotations

from hypothesis import Phase, settings

NAME = "extensible_kv_conformance"

# Registered here, so that ``--hypothesis-profile=extensible-kv-meta`` is known before any conftest loads; the rules'
# conftest loads "extensible-kv" for the rules. "extensible-kv-meta" is for the meta-tests, which re-run the rules many
# times, and for sanitizer runs.
settings.register_profile("extensible-kv", max_examples=25)
settings.register_profile(
    "extensible-kv-meta", max_examples=5, phases=[Phase.explicit, Phase.generate], database=None, derandomize=True
)

pytest_plugins = [
    f"{__name__}.watchdog",
    f"{__name__}.selection",
    f"{__name__}.summary",
    f"{__name__}.outcomes",
]  # each before its importers
