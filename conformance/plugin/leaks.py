"""The leak guard: after each rule, the driver it ran on must hold nothing the rule made.

The ``driver`` fixture hands each rule a fresh ``Ledger``, which records every reservation, handle and mapping made
through it; once the rule is over (and the garbage collector has run every finalizer), anything still recorded
fails the rule, named by count and address.
"""

from __future__ import annotations

import gc

import pytest

from extensible_kv.drivers import Ledger


def fail_if_outstanding(spec: str, ledger: Ledger) -> None:
    """Fail the current test if ``ledger`` still holds a reservation, a handle or a mapping."""
    gc.collect()
    left = ledger.outstanding()
    if left:
        pytest.fail(
            f"driver {spec}: leak after the test: expected nothing outstanding, found "
            f"{len(left.reservations)} reservation(s) {sorted(left.reservations.values())}, "
            f"{left.handles} handle(s), {len(left.mappings)} mapping(s)",
            pytrace=False,
        )
