"""The conformance suite catches broken tensors: each sabotage of the reference tensor must fail the rules it breaks.

Each case runs, in a fresh process, the rules that must catch the sabotage (``tests/meta/sabotage.py``) on the host
driver, and reads the failed tests from a JUnit XML report; the intact host drivers (host, host-4k) run every rule.
Broken drivers are ``tests/meta/broken/``'s, checked by ``test_broken_caught.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance import rule_paths

ROOT = Path(__file__).resolve().parents[2]

SABOTAGED_TENSORS = {
    "per_granule": {"test_one_handle_per_contiguous_run_of_new_granules"},
    "no_dedup": {"test_straddling_granule_is_mapped_once"},
    "wide_views": {"test_views_cover_exactly_the_committed_bytes", "test_segments_grow_in_lockstep"},
    "skip_rollback": {
        "test_failed_growth_rolls_back_completely",
        "test_failure_at_every_call_of_a_tensor_growth_step_rolls_back",
    },
    "leaky_teardown": {"test_garbage_collection_frees_exactly_once", "test_close_twice_is_harmless"},
    "single_segment": {"test_ensure_blocks_maps_the_granules_of_the_block_prefix_and_no_more"},
    "no_retract": {
        "test_failed_ensure_blocks_keeps_every_buffer_at_the_old_block_count",
        "test_failure_at_every_call_of_a_kv_growth_step_rolls_back_every_buffer",
    },
}


def run_rules(
    tmp_path: Path, driver: str, sabotage: str | None = None, rules: set[str] = frozenset()
) -> tuple[int, set[str], str]:
    """Run ``rules`` (default: all) on ``driver``; return pytest's exit code, the failed rule names, the output."""
    report = tmp_path / "junit.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("EXTENSIBLE_KV_SABOTAGE", None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *rule_paths(),
        "--driver",
        driver,
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        "--hypothesis-profile=extensible-kv-meta",
    ]
    if rules:
        cmd += ["-k", " or ".join(sorted(rules))]
    if sabotage:
        env["EXTENSIBLE_KV_SABOTAGE"] = sabotage
        cmd += ["-p", "tests.meta.sabotage"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    failed = set()
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.add(case.get("name").split("[")[0])
    return proc.returncode, failed, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.parametrize("sabotage", SABOTAGED_TENSORS, ids=list(SABOTAGED_TENSORS))
def test_suite_fails_a_sabotaged_tensor(tmp_path, sabotage):
    rc, failed, tail = run_rules(tmp_path, "host", sabotage, rules=SABOTAGED_TENSORS[sabotage])
    missing = SABOTAGED_TENSORS[sabotage] - failed
    assert rc == 1 and not missing, (
        f"tensor sabotage {sabotage} on host: expected the suite to fail (exit 1) with at least "
        f"{sorted(SABOTAGED_TENSORS[sabotage])}; got exit {rc}, failed {sorted(failed)}\n{tail}"
    )


@pytest.mark.parametrize("spec", ["host", "host-4k"])
def test_suite_passes_the_intact_host_driver(tmp_path, spec):
    rc, failed, tail = run_rules(tmp_path, spec)
    assert rc == 0 and not failed, (
        f"intact host driver {spec}: expected exit 0 and no failures; got exit {rc}, failed {sorted(failed)}\n{tail}"
    )
