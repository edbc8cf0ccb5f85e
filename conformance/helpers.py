"""Assertion and sizing helpers shared by the conformance rules.

Every failure message names the driver, the operation, the expected and the actual value. Sizes are built from the
driver's granularity so the same rule exercises 4 KiB, 2 MiB or any other granule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from extensible_kv import ExtensibleTensor
from extensible_kv.drivers import Ledger


def expect(cond: bool, driver: Ledger, op: str, expected: object, actual: object, **context: object) -> None:
    """Fail with a message naming the driver, the operation, the expected and the actual value."""
    if not cond:
        extra = "".join(f", {k}={v}" for k, v in context.items())
        raise AssertionError(f"driver {driver.name}: {op}: expected {expected}, got {actual}{extra}")


def pattern(nbytes: int, seed: int, device: torch.device) -> torch.Tensor:
    """Deterministic, position-dependent bytes (never all-zero), so misplaced or stale bytes show."""
    idx = torch.arange(nbytes, dtype=torch.int64)
    return ((idx * 131 + seed * 71 + (idx >> 9) * 17) % 251 + 1).to(torch.uint8).to(device)


def first_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str:
    actual, expected = actual.cpu().reshape(-1), expected.cpu().reshape(-1)
    diff = (actual != expected).nonzero().flatten()
    if diff.numel() == 0:
        return "none"
    i = int(diff[0])
    return f"byte {i} of {actual.numel()}: {int(actual[i])} != {int(expected[i])} ({diff.numel()} bytes differ)"


def expect_bytes(driver: Ledger, op: str, actual: torch.Tensor, expected: torch.Tensor, **context: object) -> None:
    same = actual.shape == expected.shape and bool(torch.equal(actual.cpu(), expected.cpu()))
    expect(same, driver, op, f"{expected.numel()} bytes as written", f"first mismatch at "
           f"{first_mismatch(actual, expected) if actual.shape == expected.shape else actual.shape}", **context)


def odd_tensor(driver: Ledger, num_segments: int = 3, granules_per_segment: float = 2.5,
               **kwargs: object) -> ExtensibleTensor:
    """A tensor whose segment boundaries fall inside granules (segment size a non-multiple of the granularity)."""
    g = driver.granularity()
    seg = int(granules_per_segment * g)
    seg -= seg % 256
    return ExtensibleTensor(seg * num_segments, num_segments, driver=driver, **kwargs)


def granule_states(driver: Ledger, base: int, nbytes: int) -> list[bool]:
    """For each granule of ``[base, base+nbytes)``: is it mapped and accessible, per the driver's own state."""
    g = driver.granularity()
    return [driver.accessible(base + i * g) for i in range(-(-nbytes // g))]


def expected_granules(t: ExtensibleTensor) -> list[bool]:
    """Which granules must be backed for the tensor's committed prefixes (and only those)."""
    g = t.granularity
    n = -(-t.max_num_bytes // g)
    want = [False] * n
    if t.bytes_per_segment:
        for i in range(t.num_segments):
            lo = i * t.segment_bytes
            for k in range(lo // g, -(-(lo + t.bytes_per_segment) // g)):
                want[k] = True
    return want


def device_free(driver: Ledger) -> int | None:
    """Free device bytes per cuMemGetInfo on a CUDA driver; ``None`` elsewhere."""
    return driver.mem_info()[0] if driver.device.type == "cuda" else None


class GrowthState(NamedTuple):
    """What a failed growth step of a tensor must leave as it found it."""

    mappings: dict[int, int]  # the driver's live mappings
    granules: list[bool]  # granule_states over the tensor's reservation
    free: int | None  # device_free


def growth_state(driver: Ledger, t: ExtensibleTensor) -> GrowthState:
    return GrowthState(driver.outstanding().mappings, granule_states(driver, t.base_address, t.max_num_bytes),
                       device_free(driver))


def expect_rolled_back(driver: Ledger, t: ExtensibleTensor, where: str, before: GrowthState, size: int,
                       data: list[torch.Tensor], retry: Callable[[ExtensibleTensor], object]) -> None:
    """After ``where`` (a failed growth step of ``t``): ``t`` still holds ``size`` bytes per segment, the driver's
    mappings, accessible granules and free device memory are as in ``before``, no handle is held, segment ``i``
    still reads ``data[i]``; then ``retry(t)`` succeeds and backs exactly the granules of the new size."""
    expect(t.bytes_per_segment == size, driver, f"bytes_per_segment after a {where}", size, t.bytes_per_segment)
    held = driver.outstanding()
    expect(held.mappings == before.mappings, driver, f"mappings after a {where}", before.mappings, held.mappings)
    expect(held.handles == 0, driver, f"handles held after a {where}", 0, held.handles)
    states = granule_states(driver, t.base_address, t.max_num_bytes)
    expect(states == before.granules, driver, f"accessible granules after a {where}", before.granules, states)
    if before.free is not None:
        free = device_free(driver)
        expect(free == before.free, driver, f"cuMemGetInfo free bytes after a {where}", before.free, free)
    for i, d in enumerate(data):
        expect_bytes(driver, f"segment {i} after a {where}", t.segment_view(i), d)
    retry(t)
    states, want = granule_states(driver, t.base_address, t.max_num_bytes), expected_granules(t)
    expect(states == want, driver, f"accessible granules after retrying a {where}", want, states)
