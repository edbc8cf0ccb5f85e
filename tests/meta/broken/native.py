"""Broken drivers of failed native calls (P-native-failure)."""

from __future__ import annotations

import ctypes

from extensible_kv.drivers import host
from tests.meta.broken.base import Broken


class NativeFailureNamesTheCall(Broken):
    """Native failures. Breaks "raises ``DriverError`` ... naming the operation": a failed native call names the
    libc call that failed (``mmap``, ``munmap``, ``mprotect``) as the operation, not the protocol operation."""

    breaks = "P-native-failure"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    @staticmethod
    def fail(op: str, detail: str, oom: bool = False) -> None:
        host.HostDriver.fail(detail.split("(")[0], detail, oom)


class FillFailureIsAMemoryError(Broken):
    """P-native-failure. Breaks "A native call that fails raises ``DriverError`` naming the operation, never ``OSError``
    or the native library's own error": when the ``mmap`` that fills a new handle's pages fails (the address space is
    exhausted), the fill helper raises Python's ``MemoryError``, which ``create`` lets through as it is. A failed
    ``memfd_create`` or ``ftruncate`` still raises ``DriverError``."""

    breaks = "P-native-failure"
    caught_by = ("test_every_call_the_kernel_refuses_natively_is_a_driver_error_that_leaves_nothing",)

    @staticmethod
    def fill(fd: int, size: int, byte: int) -> None:
        lib = host.libc()
        addr = lib.mmap(None, size, host.PROT_READ | host.PROT_WRITE, host.MAP_SHARED, fd, 0)
        if addr in (None, host.MAP_FAILED):
            raise MemoryError(f"cannot map {size} bytes to fill a new handle")
        try:
            ctypes.memset(addr, byte, size)
        finally:
            lib.munmap(addr, size)
