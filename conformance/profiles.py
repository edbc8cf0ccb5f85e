"""Conformance profiles: the rules a driver is not held to, and why, for drivers whose one caller guarantees the calls.

A driver names its profile in an attribute, ``conformance_profile`` (the ``vllm`` driver: ``caller-guaranteed``); a
driver without one is held to every rule. The rules' ``conftest.py`` reports each rule the profile leaves out as
skipped with the reason ``not held: <profile> profile: <why>`` (the summary JSON keeps it per rule) and lists them
after the summary table: a profile never skips a rule silently, and a profile cannot leave out a rule that is not
in its table.

Note [The caller-guaranteed profile]
    The protocol's refusals (P-bad-value, P-map-inside, P-map-overlap, P-unmap-refused, P-access-refused,
    P-free-refused, P-map-released, P-release-once) protect a tensor from a driver that would take a bad call, and a
    caller from itself. A driver written for one caller that never makes such a call (vLLM's ``VmmDriver``: its only
    caller is vLLM's ``ExtensibleTensor``, which maps only unmapped granules of its own reservation, unmaps exactly
    what it mapped, grants access over mapped runs, and passes ints) may leave them to the GPU driver, which takes
    some of them (Note [cuMem accepts what the protocol refuses] in ``drivers/cuda.py``). Under this profile the
    rules whose subject is such a refusal are not held; every rule about what valid calls do, a native failure, out
    of memory, threads and interrupts is. The tensor rules then judge that caller (``--tensor vllm``): a tensor that
    made a bad call would show there, through the Ledger's checks.
"""

from __future__ import annotations

CALLER_GUARANTEED = "caller-guaranteed"

_BAD_CALLS = "a call vLLM's ExtensibleTensor never makes: "
PROFILES: dict[str, dict[str, str]] = {
    CALLER_GUARANTEED: {
        "test_map_over_mapped_granule_is_refused": _BAD_CALLS + "a map over a live mapping (P-map-overlap)",
        "test_unmap_of_a_subrange_is_refused": _BAD_CALLS + "an unmap of part of a mapping (P-unmap-refused)",
        "test_map_outside_a_reservation_is_refused": _BAD_CALLS + "a map outside its reservation (P-map-inside)",
        "test_map_outside_one_reservation_or_over_a_mapping_is_refused_and_changes_nothing": _BAD_CALLS
        + "maps across or outside reservations, over mappings (P-map-inside, P-map-overlap)",
        "test_unmap_of_anything_but_one_whole_mapping_is_refused_and_changes_nothing": _BAD_CALLS
        + "unmaps of anything but one whole mapping (P-unmap-refused)",
        "test_set_access_on_a_range_not_fully_mapped_is_refused_and_changes_nothing": _BAD_CALLS
        + "set_access over a gap (P-access-refused)",
        "test_free_of_anything_but_one_empty_reservation_is_refused_and_changes_nothing": _BAD_CALLS
        + "a free of a used, partial or foreign reservation (P-free-refused)",
        "test_every_bad_value_of_every_call_is_refused_and_named": _BAD_CALLS
        + "a bool, float, negative or 2**63 value (P-bad-value)",
        "test_what_the_driver_never_made_is_refused_or_not_accessible": _BAD_CALLS
        + "a handle or range it never made (P-map-released, P-release-once)",
        "test_overlaps_are_refused_with_dozens_of_mappings_alive": _BAD_CALLS + "overlapping maps (P-map-overlap)",
        "test_every_range_over_mappings_and_gaps_is_judged_as_the_model_says": _BAD_CALLS
        + "ranges over gaps and several mappings (P-unmap-refused, P-access-refused)",
        "test_random_protocol_calls_match_the_model": "draws invalid calls among the valid ones: "
        + _BAD_CALLS
        + "any of them",
        "test_every_call_is_judged_as_the_model_says_at_every_count_of_live_objects": "judges refused calls at each "
        "count: " + _BAD_CALLS + "any of them",
    }
}
"""Per profile: rule (function name) -> why a driver of that profile is not held to it."""


def not_held(profile: str | None, rule: str) -> str | None:
    """The reason ``rule`` is not held under ``profile`` (``None``: held); an unknown profile is a ``ValueError``."""
    if profile is None:
        return None
    if profile not in PROFILES:
        raise ValueError(f"unknown conformance profile {profile!r}; known: {', '.join(PROFILES)}")
    reason = PROFILES[profile].get(rule)
    return None if reason is None else f"not held: {profile} profile: {reason}"
