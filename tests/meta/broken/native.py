"""Broken drivers of failed native calls (P-native-failure)."""

from __future__ import annotations

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
