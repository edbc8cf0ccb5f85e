"""The conformance suite catches broken drivers and broken tensors: each must fail the rules it breaks.

Each case runs, in a fresh process (a broken implementation may fault its own process), the rules that must catch
the breakage, and reads the failed tests from a JUnit XML report; the intact host drivers (host, host-4k) run every
rule.
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

MAP_REFUSED = "test_map_outside_one_reservation_or_over_a_mapping_is_refused_and_changes_nothing"
UNMAP_REFUSED = "test_unmap_of_anything_but_one_whole_mapping_is_refused_and_changes_nothing"
SET_ACCESS_REFUSED = "test_set_access_on_a_range_not_fully_mapped_is_refused_and_changes_nothing"
FREE_REFUSED = "test_free_of_anything_but_one_empty_reservation_is_refused_and_changes_nothing"
MEMORY_RETURNED = "test_memory_is_returned_once_unmapped_and_released"
OUT_OF_MEMORY = "test_create_past_free_memory_raises_driver_out_of_memory_and_leaks_nothing"
KERNEL_MAPS = "test_the_kernel_maps_what_accessible_reports"
FAULTS = "test_touching_a_granule_without_access_faults"
SHARED = "test_a_handle_mapped_at_two_addresses_shows_the_same_bytes_through_both"

BROKEN_DRIVERS = {
    "no_zero": {"test_zero_sets_exactly_the_range", "test_zero_new_zeroes_exactly_the_new_range"},
    "moving_base": {"test_base_address_is_stable_across_growth", "test_tensor_aliases_memory_without_copy"},
    "non_lockstep": {"test_segments_grow_in_lockstep"},
    "double_map": {"test_map_over_mapped_granule_is_refused"},
    "no_rollback": {"test_failed_growth_rolls_back_completely", "test_unmap_returns_range_to_reserved"},
    "zero_in_lines": {"test_zero_sets_exactly_the_bytes_of_any_range"},
    "zero_stops_at_16_mib": {"test_zero_of_64_mib_sets_every_byte"},
    "tensor_copies_large": {"test_tensor_of_64_mib_aliases_memory_without_copy"},
    "tensor_drops_keeper": {"test_tensor_keeps_its_keeper_alive"},
    "map_ignores_offset": {"test_map_backs_the_range_with_the_handle_bytes_at_the_offset"},
    "map_private": {SHARED, KERNEL_MAPS},
    "map_grants_access": {"test_mapping_alone_grants_no_access", FAULTS},
    "map_clamps_to_reservation": {MAP_REFUSED},
    "map_refuses_after_mapping": {MAP_REFUSED},
    "overlap_from_below": {MAP_REFUSED},
    "records_only": {KERNEL_MAPS, SHARED},
    "unmap_accepts_a_prefix": {"test_unmap_of_a_subrange_is_refused", UNMAP_REFUSED},
    "unmap_refuses_after_unmapping": {UNMAP_REFUSED},
    "set_access_on_partly_mapped": {SET_ACCESS_REFUSED},
    "set_access_refuses_after_opening": {SET_ACCESS_REFUSED},
    "free_with_mappings": {FREE_REFUSED},
    "free_of_a_subrange": {FREE_REFUSED},
    "free_keeps_the_range": {"test_free_returns_the_range_to_the_kernel"},
    "reserve_ignores_alignment": {"test_reserve_returns_a_range_aligned_to_the_alignment_asked"},
    "reserve_accessible": {FAULTS, KERNEL_MAPS},
    "release_keeps_memory": {MEMORY_RETURNED},
    "unmap_keeps_memory": {MEMORY_RETURNED, "test_closing_a_tensor_returns_its_memory"},
    "release_keeps_the_memfd": {MEMORY_RETURNED, "test_closing_a_tensor_returns_its_memory"},
    "budget_ignored": {OUT_OF_MEMORY, "test_committing_past_the_device_memory_raises_commit_out_of_memory"},
    "create_leaks_when_refused": {OUT_OF_MEMORY},
}

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


@pytest.mark.parametrize("factory", BROKEN_DRIVERS, ids=list(BROKEN_DRIVERS))
def test_suite_fails_a_broken_driver(tmp_path, factory):
    rc, failed, tail = run_rules(tmp_path, f"tests.meta.broken:{factory}", rules=BROKEN_DRIVERS[factory])
    missing = BROKEN_DRIVERS[factory] - failed
    assert rc == 1 and not missing, (
        f"broken driver {factory}: expected the suite to fail (exit 1) with at least {sorted(BROKEN_DRIVERS[factory])}"
        f"; got exit {rc}, failed {sorted(failed)}\n{tail}"
    )


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
