"""Deliberately broken host drivers: each breaks one promise, and the suite must catch each one.

Use them as ``--driver conformance.meta.broken:<factory>``. They exist only to prove that the conformance rules can
fail; every factory says which promise it breaks.
"""

from __future__ import annotations

import torch

from extensible_kv.drivers.host import _MAP_FIXED, _MAP_SHARED, _PROT_NONE, HostDriver, HostHandle, _lib


class _Broken(HostDriver):
    def __init__(self, name: str) -> None:
        super().__init__(name=name)


class NoZero(_Broken):
    """zero() does nothing: fresh pages keep their garbage."""

    def zero(self, va: int, size: int) -> None:
        pass


class MovingBase(_Broken):
    """tensor() hands out fresh memory elsewhere, so addresses seen by callers move and writes go nowhere."""

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class NonLockstep(_Broken):
    """map() silently skips the upper half of every reservation: later segments never get physical pages.

    set_access then makes the skipped range readable anonymous memory, so data round-trips and only the driver's
    own state (``accessible``) shows that the pages are not the mapped ones.
    """

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        for r_va, r_size in self._reservations.items():
            if r_va <= va < r_va + r_size and va >= r_va + r_size // 2:
                self._mappings[va] = (size, handle)
                return
        super().map(va, size, handle, offset)


class DoubleMap(_Broken):
    """map() replaces whatever is mapped at the address, as raw MAP_FIXED does, instead of refusing."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        got = _lib().mmap(va, size, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, handle.fd, offset)
        assert got == va
        for m_va in [m for m, (s, _) in self._mappings.items() if m < va + size and va < m + s]:
            del self._mappings[m_va]
        self._mappings[va] = (size, handle)


class NoRollback(_Broken):
    """unmap() forgets the mapping but leaves the pages mapped and accessible (free()'s munmap drops them with the
    reservation)."""

    def unmap(self, va: int, size: int) -> None:
        if self._mappings.get(va, (None,))[0] != size:
            super().unmap(va, size)  # keeps the sub-range refusal
        del self._mappings[va]


def no_zero() -> NoZero:
    return NoZero("broken-no-zero")


def moving_base() -> MovingBase:
    return MovingBase("broken-moving-base")


def non_lockstep() -> NonLockstep:
    return NonLockstep("broken-non-lockstep")


def double_map() -> DoubleMap:
    return DoubleMap("broken-double-map")


def no_rollback() -> NoRollback:
    return NoRollback("broken-no-rollback")
