"""The suite's pytest plugin in a project that is not the suite: no entry point loads it there, but a project that
names it (``-p extensible_kv_conformance.plugin``) to run the rules beside its own tests must see nothing else change.
Another project's own ``driver`` fixture and its tests are left alone (not parametrized over drivers), its Hypothesis
settings keep their defaults, and the header and the summary stay silent unless ``--driver`` asks for the rules.

Each run is a fresh pytest in a subprocess on a small project, with the checkout's plugin loaded by ``-p``, before any
conftest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROJECT = {
    "conftest.py": """
        import pytest

        @pytest.fixture
        def driver():
            return "theirs"
    """,
    "test_theirs.py": """
        from hypothesis import settings

        def test_their_own_driver_fixture(driver):
            assert driver == "theirs"

        def test_their_hypothesis_defaults():
            print("max_examples", settings.default.max_examples)
    """,
}


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    for name, text in PROJECT.items():
        (tmp_path / name).write_text("\n".join(line[8:] for line in text.splitlines()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXTENSIBLE_KV_", "PYTEST_"))}
    path = os.pathsep.join([str(ROOT / "reference"), str(ROOT)])
    # The checkout's copy, loaded once (an install made before the suite's entry point was dropped is blocked).
    plugin = ["-p", "no:extensible_kv_conformance", "-p", "conformance.plugin"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *plugin, "-p", "no:cacheprovider", "-v", "-s", *args],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("args", "header"), [([], False), (["--driver", "host-4k"], True)], ids=["not asked", "--driver given"]
)
def test_the_plugin_leaves_another_project_alone(tmp_path, args, header):
    proc = _run(tmp_path, *args)
    out = proc.stdout + proc.stderr
    got = {
        "exit": proc.returncode,
        "their test ran once, unparametrized": "test_theirs.py::test_their_own_driver_fixture PASSED" in out,
        "their hypothesis default": "max_examples 100" in out,
        "the suite's header": "driver host-4k: available" in out or "extensible_kv 0.1.0" in out,
        "the suite's summary": "extensible-kv conformance summary" in out,
    }
    want = {
        "exit": 0,
        "their test ran once, unparametrized": True,
        "their hypothesis default": True,
        "the suite's header": header,
        "the suite's summary": False,
    }
    assert got == want, (
        f"pytest -p conformance.plugin {' '.join(args)} in another project: expected {want}, got {got}\n{out[-3000:]}"
    )
