"""The conformance suite catches broken drivers and broken tensors: each must fail the rules it breaks.

Each case runs, in a fresh process (a broken implementation may fault its own process), the rules that must catch
the breakage, and reads the failed tests from a JUnit XML report; the intact host driver runs every rule.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[1]
ROOT = SUITE.parent

BROKEN_DRIVERS = {
    "no_zero": {"test_zero_sets_exactly_the_range", "test_zero_new_zeroes_exactly_the_new_range"},
    "moving_base": {"test_base_address_is_stable_across_growth", "test_tensor_aliases_memory_without_copy"},
    "non_lockstep": {"test_segments_grow_in_lockstep"},
    "double_map": {"test_map_over_mapped_granule_is_refused"},
    "no_rollback": {"test_failed_growth_rolls_back_completely", "test_unmap_returns_range_to_reserved"},
}

SABOTAGED_TENSORS = {
    "per_granule": {"test_one_handle_per_contiguous_run_of_new_granules"},
    "no_dedup": {"test_straddling_granule_is_mapped_once"},
    "wide_views": {"test_views_cover_exactly_the_committed_bytes", "test_segments_grow_in_lockstep"},
    "skip_rollback": {"test_failed_growth_rolls_back_completely",
                      "test_failure_at_every_call_of_a_tensor_growth_step_rolls_back"},
    "leaky_teardown": {"test_garbage_collection_frees_exactly_once", "test_close_twice_is_harmless"},
    "single_segment": {"test_ensure_blocks_maps_the_granules_of_the_block_prefix_and_no_more"},
    "no_retract": {"test_failed_ensure_blocks_keeps_every_buffer_at_the_old_block_count",
                   "test_failure_at_every_call_of_a_kv_growth_step_rolls_back_every_buffer"},
}


def run_rules(tmp_path: Path, driver: str, sabotage: str | None = None,
              rules: set[str] = frozenset()) -> tuple[int, set[str], str]:
    """Run ``rules`` (default: all) on ``driver``; return pytest's exit code, the failed rule names, the output."""
    report = tmp_path / "junit.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("EXTENSIBLE_KV_SABOTAGE", None)
    cmd = [sys.executable, "-m", "pytest", str(SUITE), "--ignore", str(SUITE / "meta"), "--ignore",
           str(SUITE / "unit"), "--driver", driver, "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
           "--hypothesis-profile=meta"]
    if rules:
        cmd += ["-k", " or ".join(sorted(rules))]
    if sabotage:
        env["EXTENSIBLE_KV_SABOTAGE"] = sabotage
        cmd += ["-p", "conformance.meta.sabotage"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    failed = set()
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.add(case.get("name").split("[")[0])
    return proc.returncode, failed, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.parametrize("factory", BROKEN_DRIVERS, ids=list(BROKEN_DRIVERS))
def test_suite_fails_a_broken_driver(tmp_path, factory):
    rc, failed, tail = run_rules(tmp_path, f"conformance.meta.broken:{factory}", rules=BROKEN_DRIVERS[factory])
    missing = BROKEN_DRIVERS[factory] - failed
    assert rc == 1 and not missing, (
        f"broken driver {factory}: expected the suite to fail (exit 1) with at least {sorted(BROKEN_DRIVERS[factory])}"
        f"; got exit {rc}, failed {sorted(failed)}\n{tail}")


@pytest.mark.parametrize("sabotage", SABOTAGED_TENSORS, ids=list(SABOTAGED_TENSORS))
def test_suite_fails_a_sabotaged_tensor(tmp_path, sabotage):
    rc, failed, tail = run_rules(tmp_path, "host", sabotage, rules=SABOTAGED_TENSORS[sabotage])
    missing = SABOTAGED_TENSORS[sabotage] - failed
    assert rc == 1 and not missing, (
        f"tensor sabotage {sabotage} on host: expected the suite to fail (exit 1) with at least "
        f"{sorted(SABOTAGED_TENSORS[sabotage])}; got exit {rc}, failed {sorted(failed)}\n{tail}")


def test_suite_passes_the_intact_host_driver(tmp_path):
    rc, failed, tail = run_rules(tmp_path, "host")
    assert rc == 0 and not failed, f"intact host driver: expected exit 0 and no failures; got exit {rc}, " \
                                   f"failed {sorted(failed)}\n{tail}"
