"""Which tensor class the tensor rules hold: ``--tensor reference`` (this project's ``ExtensibleTensor``, the default)
or ``--tensor vllm`` (vLLM's own ``ExtensibleTensor`` through ``vllm_tensor.VllmTensor``).

The rules build their tensors with ``helpers.odd_tensor`` and ``new_tensor``, which build the selected class; the
rules' ``conftest.py`` reads ``--tensor`` and selects it around each rule (``selected``). Under ``--tensor vllm`` each
rule of ``TENSOR_RULE_FILES`` is either held (``HELD_ON_VLLM``) or reported "not held" with the reason
(``NOT_HELD_ON_VLLM``): a rule about an API vLLM's class does not have, never a silent skip. A rule in those files that
is in neither table is an error, so a new rule is classified when it is written (``tests/unit/test_vllm_driver.py``).

Note [Which tensor rules hold vLLM's class]
    Held: every rule about what a growable tensor promises whatever its API: the base address never moves, data
    is kept, segments grow in lockstep and back exactly their granules, ``zero_new`` zeroes exactly the new range,
    views cover exactly the committed bytes, a failure or an interrupt at any driver call of a growth or a recommit
    leaves the old size and nothing held, release gives every page back and recommit maps zeroes at the same
    addresses, views keep the memory alive, close gives everything back. Not held: what is this project's API and
    not a property of memory (the alignment unit, ``ReleasedError``'s released state, counts of ``driver.zero``
    calls where vLLM zeroes with torch), and this project's KV buffers. vLLM's caller never sees the difference;
    the rule's reason names the API. Nor the rules' one-shot failure of a ``create``: vLLM retries a failed create
    once by design, so such a failure is absorbed and there is nothing to roll back (on the H100, 2026-12-06, the
    four such cases failed with "DID NOT RAISE CommitError"; ``reports/runs/h100-2026-12-06-vllm-native/``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from extensible_kv import ExtensibleTensor

IMPLEMENTATIONS = ("reference", "vllm")
TENSOR_RULE_FILES = (
    "test_extensible_tensor.py",
    "test_release_recommit.py",
    "test_growth_properties.py",
    "test_reliability.py",
    "test_hostile_use.py",
)
"""The rules ``--tensor vllm`` runs (the GPU script and ``tests/unit/test_vllm_driver.py`` pass these files)."""

_ALIGNMENT = "vLLM's ExtensibleTensor has no alignment unit for sizes (an API of this project)"
_RELEASED = "vLLM's release_physical keeps views and growth open by design (views go empty, growth recommits)"
_ZERO_CALLS = "counts driver.zero calls; vLLM zeroes new bytes with torch's zero_() on a view"
_KV = "holds this project's KV buffers, not a tensor"
_THREADS = "vLLM's ExtensibleTensor is not thread-safe by design (one caller: the model runner's thread)"
_COPY = "copy refusal is an API of this project"
_KEEPS_HANDLES = "vLLM keeps every handle until release_physical: a growth step releases none, so no release fails"
_RETRIES_CREATE = (
    "vLLM retries a failed create once, after emptying torch's cache (_map_chunk_at): a create the rule fails once "
    "is absorbed and the growth succeeds; rollback after a failed map or set_access is held ([map-*], [set_access-*])"
)

HELD_ON_VLLM = frozenset(
    {
        "test_base_address_is_stable_across_growth",
        "test_committed_data_survives_growth",
        "test_segments_grow_in_lockstep",
        "test_zero_new_zeroes_exactly_the_new_range",
        "test_zero_new_false_leaves_old_data_and_zeroes_nothing",
        "test_straddling_granule_is_mapped_once",
        "test_one_handle_per_contiguous_run_of_new_granules",
        "test_views_cover_exactly_the_committed_bytes",
        "test_invalid_use_raises_invalid_size_error_and_changes_nothing",
        "test_invalid_construction_raises_and_reserves_nothing",
        "test_use_after_close_raises_closed_error",
        "test_failed_growth_rolls_back_completely",
        "test_views_keep_the_tensor_alive",
        "test_garbage_collection_frees_exactly_once",
        "test_close_twice_is_harmless",
        "test_close_refuses_while_views_are_alive",
        "test_release_returns_every_page_and_keeps_the_reservation_and_size",
        "test_recommit_maps_zeroes_at_the_same_addresses",
        "test_a_failed_recommit_leaves_the_tensor_released_and_holding_nothing",
        "test_random_growth_matches_a_bytearray_model",
        "test_failure_at_every_call_of_a_tensor_growth_step_rolls_back",
        "test_failed_reservation_leaves_nothing_behind",
        "test_lifecycle_under_garbage_collection_stress",
        "test_an_interrupted_close_can_be_retried_and_returns_everything",
        "test_sizes_past_the_address_space_are_refused_before_any_driver_call",
    }
)
"""Rules (function names, with every parametrization not in ``NOT_HELD_ON_VLLM``) that hold vLLM's class."""

NOT_HELD_ON_VLLM: dict[str, str] = {
    "test_zeroing_is_one_memset_per_contiguous_new_range": _ZERO_CALLS,
    "test_invalid_use_raises_invalid_size_error_and_changes_nothing[misaligned_size]": _ALIGNMENT,
    "test_invalid_construction_raises_and_reserves_nothing[segment_not_multiple_of_alignment]": _ALIGNMENT,
    "test_use_after_close_raises_closed_error[stats]": "stats() is an API of this project",
    "test_failed_growth_rolls_back_completely[create-1]": _RETRIES_CREATE,
    "test_failed_growth_rolls_back_completely[create-2]": _RETRIES_CREATE,
    "test_failed_growth_rolls_back_completely[zero-1]": _ZERO_CALLS,
    "test_failed_growth_rolls_back_completely[release-2]": _KEEPS_HANDLES,
    "test_failed_growth_rolls_back_completely[zero-3]": _ZERO_CALLS,
    "test_a_released_tensor_refuses_views_growth_and_a_second_release": _RELEASED,
    "test_a_failed_recommit_leaves_the_tensor_released_and_holding_nothing[create]": _RETRIES_CREATE,
    "test_a_failed_recommit_leaves_the_tensor_released_and_holding_nothing[zero]": _ZERO_CALLS,
    "test_a_failed_recommit_leaves_the_tensor_released_and_holding_nothing[release]": _KEEPS_HANDLES,
    "test_kv_buffers_release_and_recommit_every_buffer_under_the_same_addresses": _KV,
    "test_failure_at_every_call_of_a_tensor_growth_step_rolls_back[driver_error]": "its sweep fails the step's "
    "first create first: " + _RETRIES_CREATE,
    "test_failure_at_every_call_of_a_kv_growth_step_rolls_back_every_buffer": _KV,
    "test_a_rollback_that_fails_too_is_reported_and_close_returns_what_it_kept": "reads this project's rollback report",
    "test_a_handle_the_rollback_cannot_release_is_reported_and_close_releases_it": "reads this project's rollback "
    "report",
    "test_concurrent_growth_serializes_to_the_largest_size": _THREADS,
    "test_concurrent_ensure_blocks_serializes_to_the_largest_count": _KV,
    "test_a_view_is_never_handed_out_over_a_closed_tensor": _THREADS,
    "test_growth_racing_close_ends_closed_with_nothing_outstanding": _THREADS,
    "test_kv_buffers_refuse_every_use_after_close": _KV,
    "test_kv_growth_is_all_or_nothing_when_a_buffer_was_closed_underneath": _KV,
    "test_tensors_and_kv_buffers_refuse_to_be_copied": _COPY,
    "test_an_interrupted_close_can_be_retried_and_returns_everything[synchronize]": "vLLM's free() synchronizes "
    "with torch.accelerator, not driver.synchronize",
}
"""Rules, or one parametrization of a rule (``name[id]``), reported "not held" under ``--tensor vllm``, and why."""


class _Selected:
    name = "reference"
    saved: dict[str, Any] = {}
    facades: dict[int, Any] = {}


def not_held(file_name: str, rule: str, param_id: str | None) -> str | None:
    """Under ``--tensor vllm``: why ``rule`` (with ``param_id``) is not held, ``None`` when it is held; a rule of
    ``TENSOR_RULE_FILES`` in neither table raises ``LookupError``. Rules outside those files hold the driver, not a
    tensor: ``"holds no tensor"``."""
    if file_name not in TENSOR_RULE_FILES:
        return "holds the driver, not a tensor (run without --tensor vllm)"
    if param_id is not None and f"{rule}[{param_id}]" in NOT_HELD_ON_VLLM:
        return NOT_HELD_ON_VLLM[f"{rule}[{param_id}]"]
    if rule in NOT_HELD_ON_VLLM:
        return NOT_HELD_ON_VLLM[rule]
    if rule in HELD_ON_VLLM:
        return None
    raise LookupError(f"{file_name}::{rule} is in neither HELD_ON_VLLM nor NOT_HELD_ON_VLLM of conformance/tensors.py")


@contextlib.contextmanager
def selected(name: str) -> Iterator[None]:
    """Build ``name``'s tensors in ``odd_tensor``/``new_tensor`` until the block ends (one rule)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"--tensor {name!r}: one of {', '.join(IMPLEMENTATIONS)}")
    _Selected.name = name
    try:
        yield
    finally:
        _Selected.name = "reference"
        _Selected.facades.clear()
        if _Selected.saved:
            from . import vllm_tensor

            vllm_tensor.restore(_Selected.saved)


def current() -> str:
    return _Selected.name


def new_tensor(max_num_bytes: int, num_segments: int = 1, *, driver: Any, **kwargs: Any) -> Any:
    """A tensor of the selected class, on ``driver`` (the rules' Ledger)."""
    if _Selected.name == "reference":
        return ExtensibleTensor(max_num_bytes, num_segments, driver=driver, **kwargs)
    from . import vllm_tensor

    facade = _Selected.facades.get(id(driver))
    if facade is None:
        facade = _Selected.facades[id(driver)] = vllm_tensor.install(driver, _Selected.saved)
    return vllm_tensor.VllmTensor(max_num_bytes, num_segments, driver=driver, facade=facade, **kwargs)


def zeroes_through_driver() -> bool:
    """Whether the selected class zeroes new bytes with ``driver.zero`` (this project's) or otherwise (vLLM's zeroes
    with torch)."""
    return _Selected.name == "reference"
