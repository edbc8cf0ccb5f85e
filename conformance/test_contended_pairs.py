"""The rule of contended pairs (``protocol_pairs.py``: Note [Stalls inside the driver], Note [A waiting call lands in
the gap]): every pair of protocol calls that can touch one range or one handle, from two threads, at every line of the
driver's own code, judged against the model's serial orders."""

from __future__ import annotations

import pytest

from .protocol_pairs import PAIRS, run_pair


@pytest.mark.parametrize("pair", PAIRS)
def test_each_contended_pair_at_every_line_matches_a_serial_order(driver, pair):
    """``pair`` from two threads, one stalled at every line of the driver's own code and the other's call started at
    each of those lines in turn, both ways round (Note [Stalls inside the driver]), the waiting call repeated where
    the records hold it back (Note [A waiting call lands in the gap]): each try's outcomes are those of some serial
    order of its calls, the kernel shows at every shared granule, and mem_info says, what that order leaves, and
    everything given back after each try leaves nothing in the kernel there. Checks: P-threads, P-map-overlap,
    P-unmap-refused, P-access-refused, P-free-refused, P-release-once, P-release-returns, P-create-oom,
    P-reserve-disjoint, P-mem-exact."""
    run_pair(driver, pair)
