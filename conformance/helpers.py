"""Assertion and sizing helpers shared by the conformance rules.

Every failure message names the driver, the operation, the expected and the actual value. Sizes are built from the
driver's granularity so the same rule exercises 4 KiB, 2 MiB or any other granule.
"""

from __future__ import annotations

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
