"""A recording fake of cuda-bindings' ``cuda.bindings.driver`` module, for the CUDA driver's logic on a CPU.

``FakeCuda`` answers the calls the CUDA driver makes the way cuda-bindings does: every function takes its arguments
positionally, exactly as many as the C function has (a call with any other count raises ``TypeError``), and returns
a tuple whose first element is a ``CUresult``; addresses and handles come back as wrapper objects that only ``int()``
opens. Behind the calls it keeps a small model of CUDA virtual memory (reservations, handles, mappings, access per
mapping, bytes held) and refuses what the driver API refuses with ``CUDA_ERROR_INVALID_VALUE``: sizes and addresses
off the granularity, a map over a mapped range or outside every reservation, an unmap of anything but one mapping, a
free of a reservation with mappings, a release of an unknown handle, a create past the free bytes
(``CUDA_ERROR_OUT_OF_MEMORY``).

Every call is recorded in ``calls`` as ``(name, args)``. ``fail(name, error)`` makes the next call of ``name`` return
``error`` without touching the model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

MIB = 1 << 20
VA_BASE = 0x7F00_0000_0000


class CUresult(enum.IntEnum):  # cuda-bindings' names
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_INVALID = 0
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAccess_flags(enum.IntEnum):
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(enum.IntEnum):
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


class _Opaque:
    """A cuda-bindings wrapper (``CUdeviceptr``, ``CUmemGenericAllocationHandle``, ...): ``int()`` opens it."""

    def __init__(self, value: int) -> None:
        self._value = value

    def __int__(self) -> int:
        return self._value

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._value:#x}>"


class CUdeviceptr(_Opaque):
    pass


class CUmemGenericAllocationHandle(_Opaque):
    pass


class CUdevice(_Opaque):
    pass


class CUcontext(_Opaque):
    pass


class CUmemLocation:
    def __init__(self) -> None:
        self.type = CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID
        self.id = 0


class CUmemAllocationProp:
    def __init__(self) -> None:
        self.type = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_INVALID
        self.location = CUmemLocation()


class CUmemAccessDesc:
    def __init__(self) -> None:
        self.location = CUmemLocation()
        self.flags = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE


@dataclass
class Handle:
    size: int
    released: bool = False
    mappings: int = 0


@dataclass
class FakeCuda:
    """The fake module: enums and structs as attributes, ``cu*`` functions as methods, a VMM model behind them."""

    granularity: int = 2 * MIB
    total: int = 64 * MIB
    calls: list[tuple[str, tuple]] = field(default_factory=list)
    reservations: dict[int, int] = field(default_factory=dict)  # va -> size
    handles: dict[int, Handle] = field(default_factory=dict)
    mappings: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # va -> (size, handle, offset)
    access: dict[int, int] = field(default_factory=dict)  # mapping va -> flags
    _failing: dict[str, CUresult] = field(default_factory=dict)
    _next_va: int = VA_BASE
    _next_handle: int = 1

    CUresult = CUresult
    CUmemAllocationType = CUmemAllocationType
    CUmemLocationType = CUmemLocationType
    CUmemAccess_flags = CUmemAccess_flags
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUdevice_attribute = CUdevice_attribute
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc

    # -- what a test reads and sets -------------------------------------------------------------------------------
    def fail(self, name: str, error: CUresult = CUresult.CUDA_ERROR_INVALID_VALUE) -> None:
        self._failing[name] = error

    def held(self) -> int:
        return sum(h.size for h in self.handles.values() if not h.released or h.mappings)

    def live_handles(self) -> set[int]:
        return {k for k, h in self.handles.items() if not h.released}

    def _enter(self, name: str, *args: object) -> CUresult | None:
        self.calls.append((name, args))
        return self._failing.pop(name, None)

    def _off_grid(self, *values: int) -> bool:
        return any(int(v) % self.granularity for v in values)

    def _mapping_at(self, va: int) -> int | None:
        return next((start for start, (size, _, _) in self.mappings.items() if start <= va < start + size), None)

    # -- initialisation ---------------------------------------------------------------------------------------------
    def cuInit(self, flags):
        return (self._enter("cuInit", flags) or CUresult.CUDA_SUCCESS,)

    def cuDeviceGetCount(self):
        return self._enter("cuDeviceGetCount") or CUresult.CUDA_SUCCESS, 1

    def cuDeviceGet(self, ordinal):
        return self._enter("cuDeviceGet", ordinal) or CUresult.CUDA_SUCCESS, CUdevice(ordinal)

    def cuDeviceGetAttribute(self, attrib, dev):
        return self._enter("cuDeviceGetAttribute", attrib, dev) or CUresult.CUDA_SUCCESS, 1

    def cuDevicePrimaryCtxRetain(self, dev):
        return self._enter("cuDevicePrimaryCtxRetain", dev) or CUresult.CUDA_SUCCESS, CUcontext(0xC0)

    def cuCtxSetCurrent(self, ctx):
        return (self._enter("cuCtxSetCurrent", ctx) or CUresult.CUDA_SUCCESS,)

    def cuMemGetAllocationGranularity(self, prop, option):
        err = self._enter("cuMemGetAllocationGranularity", prop, option)
        return err or CUresult.CUDA_SUCCESS, self.granularity

    def cuMemGetInfo(self):
        err = self._enter("cuMemGetInfo")
        return err or CUresult.CUDA_SUCCESS, self.total - self.held(), self.total

    # -- virtual memory ---------------------------------------------------------------------------------------------
    def cuMemAddressReserve(self, size, alignment, addr, flags):
        err = self._enter("cuMemAddressReserve", size, alignment, addr, flags)
        if err or self._off_grid(size, alignment) or size <= 0:
            return err or CUresult.CUDA_ERROR_INVALID_VALUE, CUdeviceptr(0)
        step = max(int(alignment), self.granularity)
        va = -(-self._next_va // step) * step
        self._next_va = va + size + self.granularity  # a gap, so neighbours never touch
        self.reservations[va] = size
        return CUresult.CUDA_SUCCESS, CUdeviceptr(va)

    def cuMemAddressFree(self, ptr, size):
        err = self._enter("cuMemAddressFree", ptr, size)
        va = int(ptr)
        inside = any(va <= m < va + size for m in self.mappings)
        if err or self.reservations.get(va) != size or inside:
            return (err or CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.reservations[va]
        return (CUresult.CUDA_SUCCESS,)

    def cuMemCreate(self, size, prop, flags):
        err = self._enter("cuMemCreate", size, prop, flags)
        if err or self._off_grid(size) or size <= 0 or not isinstance(prop, CUmemAllocationProp):
            return err or CUresult.CUDA_ERROR_INVALID_VALUE, CUmemGenericAllocationHandle(0)
        if self.held() + size > self.total:
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY, CUmemGenericAllocationHandle(0)
        key, self._next_handle = self._next_handle, self._next_handle + 1
        self.handles[key] = Handle(size)
        return CUresult.CUDA_SUCCESS, CUmemGenericAllocationHandle(key)

    def cuMemRelease(self, handle):
        err = self._enter("cuMemRelease", handle)
        h = self.handles.get(int(handle))
        if err or h is None or h.released:
            return (err or CUresult.CUDA_ERROR_INVALID_VALUE,)
        h.released = True
        return (CUresult.CUDA_SUCCESS,)

    def cuMemMap(self, ptr, size, offset, handle, flags):
        err = self._enter("cuMemMap", ptr, size, offset, handle, flags)
        va, h = int(ptr), self.handles.get(int(handle))
        inside = any(r <= va and va + size <= r + n for r, n in self.reservations.items())
        overlaps = any(m < va + size and va < m + n for m, (n, _, _) in self.mappings.items())
        if err or h is None or self._off_grid(va, size, offset) or not inside or overlaps or offset + size > h.size:
            return (err or CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.mappings[va] = (size, int(handle), offset)
        h.mappings += 1
        return (CUresult.CUDA_SUCCESS,)

    def cuMemUnmap(self, ptr, size):
        err = self._enter("cuMemUnmap", ptr, size)
        va = int(ptr)
        if err or va not in self.mappings or self.mappings[va][0] != size:
            return (err or CUresult.CUDA_ERROR_INVALID_VALUE,)
        _, key, _ = self.mappings.pop(va)
        self.access.pop(va, None)
        self.handles[key].mappings -= 1
        return (CUresult.CUDA_SUCCESS,)

    def cuMemSetAccess(self, ptr, size, desc, count):
        err = self._enter("cuMemSetAccess", ptr, size, desc, count)
        va = int(ptr)
        covered = [m for m, (n, _, _) in self.mappings.items() if va <= m and m + n <= va + size]
        whole = sum(self.mappings[m][0] for m in covered) == size
        if err or not whole or count != len(desc) or not all(isinstance(d, CUmemAccessDesc) for d in desc):
            return (err or CUresult.CUDA_ERROR_INVALID_VALUE,)
        for m in covered:
            self.access[m] = int(desc[0].flags)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemGetAccess(self, location, ptr):
        err = self._enter("cuMemGetAccess", location, ptr)
        start = self._mapping_at(int(ptr))
        if err or start is None or not isinstance(location, CUmemLocation):
            return err or CUresult.CUDA_ERROR_INVALID_VALUE, 0
        return CUresult.CUDA_SUCCESS, self.access.get(start, 0)

    def cuMemsetD8Async(self, dstDevice, uc, N, hStream):
        err = self._enter("cuMemsetD8Async", dstDevice, uc, N, hStream)
        va = int(dstDevice)
        readable = all(self.access.get(self._mapping_at(a) or -1) for a in range(va, va + N, self.granularity))
        return (err or (CUresult.CUDA_SUCCESS if readable else CUresult.CUDA_ERROR_INVALID_VALUE),)
