"""The vLLM version gate: a supported release is patched, one outside the table is refused in one line and left
untouched, 0.34 is left to its own extensible KV cache; the patch-point check reads a release's source."""

from __future__ import annotations

import logging
import os
import sys
import types
from pathlib import Path

import pytest

from extensible_kv import vllm as ekv_vllm
from extensible_kv.vllm import patches, plugin, versions

SOURCES_ENV = "EXTENSIBLE_KV_VLLM_SOURCES"
"""A folder of ``<version>/vllm/`` source trees (``nox -s vllm_versions`` unpacks every release's wheel there)."""

EXPECTED = {
    "0.26.0": [],
    "0.27.0": [],
    "0.28.0": ["vllm.v1.engine.core.get_kv_cache_capacity is absent"],
    **dict.fromkeys(("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"), 9),
}
"""What ``check_patch_points`` finds in each release (the differences, or how many), read from the wheels: from
0.29 the model runner allocates the KV cache through a ``kv_cache_allocation_context``, which the patch set does
not know."""


def _write_tree(root: Path, renamed: str | None = None) -> Path:
    """A vLLM source tree with every patch point and called name as the patch set expects (``renamed``: that
    function's first parameter is renamed), nothing else."""
    wanted: dict[str, dict[str | None, list[str]]] = {}
    for table in (versions.PATCH_POINTS, versions.CALLED_NAMES):
        for (module, owner, name), params in table.items():
            params = list(params or ("self",) if owner else params or ())
            if name == renamed:
                params[0] = params[0] + "_renamed"
            wanted.setdefault(module, {}).setdefault(owner, []).append(f"def {name}({', '.join(params)}): ...")
    for module, owners in wanted.items():
        path = root.joinpath(*module.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = list(owners.get(None, []))
        for owner, defs in owners.items():
            if owner is not None:
                lines += [f"class {owner}:", *("    " + d for d in defs)]
        path.write_text("\n".join(lines) + "\n")
    (root / "vllm" / "__init__.py").write_text("")
    return root / "vllm"


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """A ``vllm`` module of a chosen version over a source tree with every patch point; ``install`` recorded."""
    source = _write_tree(tmp_path)
    module = types.ModuleType("vllm")
    module.__file__ = str(source / "__init__.py")
    monkeypatch.setitem(sys.modules, "vllm", module)
    installs: list[int] = []
    monkeypatch.setattr(patches, "install", lambda: installs.append(1))
    return module, installs


def _one_line(caplog, level: int) -> str:
    records = [r for r in caplog.records if r.name == "extensible_kv.vllm"]
    assert len(records) == 1 and records[0].levelno == level, [(r.levelname, r.getMessage()) for r in records]
    message = records[0].getMessage()
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("version", ["0.26.0", "0.27.0", "0.33.1"])
def test_a_release_of_the_table_whose_patch_points_match_is_patched(fake_vllm, caplog, version):
    module, installs = fake_vllm
    module.__version__ = version
    caplog.set_level(logging.INFO, logger="extensible_kv.vllm")
    decision = ekv_vllm.enable()
    assert (decision.action, installs) == (versions.PATCH, [1]), (decision, installs)


@pytest.mark.parametrize("version", ["0.99.0", "0.25.2", "0.35.0", "1.0.0", "nightly"])
def test_a_release_outside_the_table_is_refused_in_one_line_and_vllm_is_untouched(fake_vllm, caplog, version):
    module, installs = fake_vllm
    module.__version__ = version
    before = dict(vars(module))
    caplog.set_level(logging.INFO, logger="extensible_kv.vllm")
    decision = ekv_vllm.enable()
    message = _one_line(caplog, logging.WARNING)
    assert decision.action == versions.REFUSE and installs == [] and not patches.installed(), (decision, installs)
    assert f"vLLM {version} is not in the supported table ({versions.TABLE_LINE})" in message, message
    assert dict(vars(module)) == before


def test_0_34_is_left_to_its_own_extensible_kv_cache_with_one_line_saying_what_is_checked(fake_vllm, caplog):
    module, installs = fake_vllm
    module.__version__ = "0.34.0"
    caplog.set_level(logging.INFO, logger="extensible_kv.vllm")
    decision = ekv_vllm.enable()
    message = _one_line(caplog, logging.INFO)
    assert decision.action == versions.NATIVE and installs == [], (decision, installs)
    assert "no KV patch installed" in message and "check-driver vllm" in message, message


def test_a_release_whose_patch_point_changed_is_refused_naming_the_point(monkeypatch, tmp_path, caplog):
    source = _write_tree(tmp_path, renamed="_allocate_kv_cache_tensors")
    decision = versions.decide("0.30.0", source)
    assert decision.action == versions.REFUSE, decision
    assert "GPUModelRunner._allocate_kv_cache_tensors('self_renamed', 'kv_cache_config')" in decision.message, (
        decision.message
    )


def test_a_missing_module_is_named():
    problems = versions.check_patch_points(Path("/nonexistent/vllm"))
    assert problems and problems[0].endswith("module vllm.v1.engine.core is absent"), problems


def test_the_plugin_entry_goes_through_the_gate_and_never_raises_on_a_refusal(fake_vllm, monkeypatch, caplog):
    module, installs = fake_vllm
    module.__version__ = "0.99.0"
    monkeypatch.setenv(ekv_vllm.ENV_VAR, "1")
    plugin.register()
    assert installs == [], installs
    module.__version__ = "0.26.0"
    plugin.register()
    assert installs == [1], installs


def test_every_function_the_patch_set_wraps_has_its_parameters_in_the_table():
    wrapped = {(p.module, p.owner, p.attr) for p in patches.PATCHES if not p.attr.startswith("extensible_kv_")}
    assert wrapped == set(versions.PATCH_POINTS), wrapped ^ set(versions.PATCH_POINTS)


def _sources() -> Path | None:
    value = os.environ.get(SOURCES_ENV)
    return Path(value) if value else None


@pytest.mark.skipif(_sources() is None, reason=f"{SOURCES_ENV} is not set: run `nox -s vllm_versions`")
@pytest.mark.parametrize("version", EXPECTED)
def test_each_releases_patch_points_as_read_from_its_wheel(version):
    root = _sources() / version / "vllm"
    assert root.is_dir(), f"{root}: no source of vLLM {version}"
    problems = versions.check_patch_points(root)
    want = EXPECTED[version]
    if isinstance(want, list):
        assert problems == want, problems
    else:
        assert len(problems) == want and "'kv_cache_allocation_context')" in problems[0], problems
