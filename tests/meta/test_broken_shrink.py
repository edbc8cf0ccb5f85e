"""The shrink rules (``conformance/test_shrink.py``) catch broken shrinks: each sabotage of
``tests/meta/sabotage_shrink.py`` must fail the rules it breaks, each run in a fresh process (a broken shrink may
leave a view over unmapped memory); the intact tensor passes the same rules."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .sabotage_shrink import SABOTAGE

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "conformance" / "test_shrink.py"
LIFECYCLE = ROOT / "conformance" / "test_lifecycle_model.py"
LIFECYCLE_RULE = "test_the_lifecycle_matches_the_model"
LIFECYCLE_EXAMPLES = "60"
"""Examples of the lifecycle machine per sabotage run (derandomized: each run draws the same sequences); at 60 each
sabotage of ``LIFECYCLE_CATCHES`` fails within seconds on host-4k."""
MEMORY = "test_a_shrink_returns_the_memory_of_the_released_granules"
KEPT = "test_a_shrink_keeps_every_address_and_the_bytes_below_the_new_size"
REGROW = "test_growth_after_a_shrink_maps_exactly_the_released_granules_and_zeroes_them"
REFUSED = "test_a_view_or_a_pin_reaching_past_the_new_size_refuses_the_shrink_and_changes_nothing"
FAILURE = "test_a_driver_failure_in_a_shrink_is_typed_and_leaves_the_old_size_or_failed"
KV_FAILURE = "test_kv_shrink_blocks_failing_in_one_buffer_grows_the_others_back"
LINEAGE = "test_a_checkpoint_taken_before_a_shrink_is_refused_and_one_after_rolls_back"
INTERRUPTED = "test_a_shrink_interrupted_at_any_line_leaves_the_old_size_or_failed"
KV_INTERRUPTED = "test_a_kv_shrink_interrupted_at_any_line_leaves_the_old_count_or_failed"

CAUGHT_BY = {
    "forgets_to_release": {MEMORY, KEPT, REGROW},
    "one_granule_too_many": {MEMORY, KEPT, REGROW},
    "lazy_unzeroed_regrow": {MEMORY, REGROW},
    "unzeroed_regrow": {REGROW},
    "keeps_lineage": {LINEAGE},
    "unguarded": {REFUSED},
    "no_abort": {FAILURE, INTERRUPTED},
    "kv_no_regrow": {KV_FAILURE, KV_INTERRUPTED},
}
"""Each sabotage, and the rules that must fail on it."""
LIFECYCLE_CATCHES = ("forgets_to_release", "one_granule_too_many", "lazy_unzeroed_regrow", "unzeroed_regrow")
"""The sabotages the lifecycle model must catch too (its random sequences do not reach a failing driver call inside
a shrink, nor a write through a view a broken guard left over unmapped memory, which would fault the process)."""


def _run(
    tmp_path: Path, sabotage: str | None, rules: set[str], path: Path = RULES, driver: str = "host-4k"
) -> tuple[int, set[str], str]:
    report = tmp_path / "junit.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("EXTENSIBLE_KV_SHRINK_SABOTAGE", None)
    env["EXTENSIBLE_KV_LIFECYCLE_EXAMPLES"] = LIFECYCLE_EXAMPLES
    cmd = [sys.executable, "-m", "pytest", str(path), "--driver", driver, "-q", "-p", "no:cacheprovider"]
    cmd += ["--hypothesis-profile=extensible-kv-meta"]
    cmd += [f"--junitxml={report}", "-k", " or ".join(sorted(rules))]
    if sabotage:
        env["EXTENSIBLE_KV_SHRINK_SABOTAGE"] = sabotage
        cmd += ["-p", "tests.meta.sabotage_shrink"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    failed = set()
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.add(case.get("name").split("[")[0])
    return proc.returncode, failed, (proc.stdout + proc.stderr)[-3000:]


def test_every_sabotage_names_the_rules_that_catch_it():
    assert set(CAUGHT_BY) == set(SABOTAGE), (
        f"expected a CAUGHT_BY entry per sabotage {sorted(SABOTAGE)}, got {sorted(CAUGHT_BY)}"
    )


@pytest.mark.parametrize("sabotage", sorted(CAUGHT_BY))
def test_the_shrink_rules_fail_a_broken_shrink(tmp_path, sabotage):
    rc, failed, tail = _run(tmp_path, sabotage, CAUGHT_BY[sabotage])
    missing = CAUGHT_BY[sabotage] - failed
    assert rc == 1 and not missing, (
        f"shrink sabotage {sabotage} on host-4k: expected exit 1 with at least {sorted(CAUGHT_BY[sabotage])} failed; "
        f"got exit {rc}, failed {sorted(failed)}\n{tail}"
    )


def test_the_shrink_rules_pass_the_intact_tensor(tmp_path):
    rules = set().union(*CAUGHT_BY.values())
    rc, failed, tail = _run(tmp_path, None, rules)
    assert rc == 0 and not failed, (
        f"intact tensor on host-4k: expected exit 0, no failures; got exit {rc}, failed {sorted(failed)}\n{tail}"
    )


@pytest.mark.parametrize("sabotage", LIFECYCLE_CATCHES)
def test_the_lifecycle_model_fails_a_broken_shrink(tmp_path, sabotage):
    rc, failed, tail = _run(tmp_path, sabotage, {LIFECYCLE_RULE}, LIFECYCLE)
    assert rc == 1 and LIFECYCLE_RULE in failed, (
        f"shrink sabotage {sabotage} on host-4k: expected {LIFECYCLE_RULE} to fail (exit 1); got exit {rc}, failed "
        f"{sorted(failed)}\n{tail}"
    )


def test_the_lifecycle_model_passes_the_intact_tensor(tmp_path):
    rc, failed, tail = _run(tmp_path, None, {LIFECYCLE_RULE}, LIFECYCLE)
    assert rc == 0 and not failed, (
        f"intact tensor on host-4k: expected exit 0, no failures; got exit {rc}, {failed}\n{tail}"
    )
