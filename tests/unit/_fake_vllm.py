"""A fake of vLLM 0.34's ``VmmDriver`` (``vllm/utils/vmm_driver.py``): its method signatures, its error type
(``RuntimeError("GPU driver error N: ...")``) and its ctypes entry table, without a GPU; and a host driver that names
the caller-guaranteed conformance profile, for the profile's selection."""

from __future__ import annotations

import ctypes
from typing import Any

from extensible_kv.drivers.host import HostDriver

G = 2 << 20


class FakeVmm:
    """Records every call; ``fail[name] = code`` makes the next call of ``name`` raise as vLLM's driver does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.fail: dict[str, int] = {}
        self.next_va = 64 * G
        self.next_handle = 1
        self.mapped: set[int] = set()
        self._fns = {"address_reserve": self._address_reserve}

    def _record(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        code = self.fail.pop(name, None)
        if code is not None:
            self._check(code)

    def _check(self, result: int) -> None:  # vLLM's VmmDriver._check
        if result != 0:
            raise RuntimeError(f"GPU driver error {result}: fake error")

    def _address_reserve(self, dptr_ref: Any, size: int, alignment: int, addr: int, flags: int) -> int:
        self.calls.append(("address_reserve", (size, alignment)))
        va = -(-self.next_va // alignment) * alignment
        self.next_va = va + size
        ctypes.cast(dptr_ref, ctypes.POINTER(ctypes.c_ulonglong)).contents.value = va
        return 0

    def ensure_context(self, device_index: int) -> None:
        self.calls.append(("ensure_context", (device_index,)))

    def granularity(self, device_index: int) -> int:
        self._record("granularity", device_index)
        return G

    def reserve(self, size: int) -> int:
        self._record("reserve", size)
        va, self.next_va = self.next_va, self.next_va + size
        return va

    def free_reserved(self, ptr: int, size: int) -> None:
        self._record("free_reserved", ptr, size)

    def create(self, size: int, device_index: int, export_handle_types: int = 0) -> int:
        self._record("create", size, device_index)
        self.next_handle += 1
        return self.next_handle

    def map(self, ptr: int, size: int, handle: int) -> None:
        self._record("map", ptr, size, handle)
        self.mapped.add(ptr)

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        self._record("set_access", ptr, size, device_index)

    def unmap(self, ptr: int, size: int) -> None:
        self._record("unmap", ptr, size)
        self.mapped.discard(ptr)

    def release(self, handle: int) -> None:
        self._record("release", handle)

    def accessible(self, va: int, ordinal: int) -> bool:
        return va in self.mapped


class ProfiledHost(HostDriver):
    """The host driver naming the caller-guaranteed profile, as the vllm driver does."""

    conformance_profile = "caller-guaranteed"


def profiled_host() -> ProfiledHost:
    return ProfiledHost(budget_bytes=1 << 30, name="profiled-host")
