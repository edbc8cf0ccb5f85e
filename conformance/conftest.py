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

from . import load_plugin, profiles, tensors

PROFILE = "extensible-kv"  # registered by the plugin, with "extensible-kv-meta"


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    load_plugin(pluginmanager)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("hypothesis_profile", default=None) is None:
        settings.load_profile(PROFILE)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("extensible-kv").addoption(
        "--tensor",
        action="store",
        default="reference",
        choices=tensors.IMPLEMENTATIONS,
        help="the tensor class the tensor rules hold: reference (this project's) or vllm (vLLM's own, vLLM >= 0.34); "
        "see conformance/tensors.py",
    )


def _param_id(node: pytest.Item, spec: str | None) -> str | None:
    """The id of ``node``'s parametrization less the driver's part (``misaligned_size`` of
    ``[host-misaligned_size]``)."""
    name = node.name
    if "[" not in name:
        return None
    ids = name[name.index("[") + 1 : -1]
    if spec is not None:
        for cut in (f"{spec}-", f"-{spec}"):
            if ids.startswith(cut) or ids.endswith(cut):
                ids = ids[len(cut) :] if ids.startswith(cut) else ids[: -len(cut)]
                break
        else:
            ids = "" if ids == spec else ids
    return ids or None


@pytest.fixture(autouse=True)
def _profile_and_tensor(request: pytest.FixtureRequest):
    """Before the ``driver`` fixture: a rule the driver's conformance profile leaves out, or one that does not hold
    the ``--tensor`` selected, is reported "not held" with its reason (``profiles``, ``tensors``); the selected
    tensor class is built by the rule's ``odd_tensor``/``new_tensor``."""
    node = request.node
    rule = getattr(node, "originalname", node.name)
    spec = node.callspec.params.get("driver_spec") if hasattr(node, "callspec") else None
    if spec is not None:
        from .plugin.selection import build

        built = build(request.config, spec)
        profile = None if isinstance(built, str) else getattr(built, "conformance_profile", None)
        reason = profiles.not_held(profile, rule)
        if reason:
            pytest.skip(reason)
    impl = request.config.getoption("tensor", default="reference")
    if impl != "reference":
        why = tensors.not_held(node.path.name, rule, _param_id(node, spec))
        if why:
            pytest.skip(f"not held: --tensor {impl}: {why}")
    with tensors.selected(impl):
        yield


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Every rule reported "not held" in this run, one line each with its reason."""
    rows = []
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        reason = str(longrepr[2]).removeprefix("Skipped: ") if isinstance(longrepr, tuple) else ""
        if reason.startswith("not held:"):
            rows.append(f"{report.nodeid}: {reason}")
    if rows:
        terminalreporter.section(f"rules not held ({len(rows)})")
        for row in sorted(rows):
            terminalreporter.write_line(row)
