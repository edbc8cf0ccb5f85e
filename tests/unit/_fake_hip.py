"""A recording fake of hip-python's ``hip.hip`` module, for testing the HIP driver's logic on a CPU.

``FakeHip`` answers the calls the HIP driver makes the way hip-python does: every function returns a tuple whose
first element is a ``hipError_t``, struct wrappers start out as garbage until each field is set (hip-python
allocates them with ``malloc``), enum-typed fields only take members of their enum, and ``hipMemAddressReserve``
returns a pointer object, not an int. Behind the calls it keeps a small model of HIP virtual memory (reservations,
handles, mappings, access per mapping) that refuses what ROCm refuses:

- ``hipMemMap`` with a non-zero offset or flags (the offset "currently must be zero");
- ``hipMemSetAccess`` over a range that is not exactly one mapping, when ``access_per_mapping`` is on (the default;
  ROCm/rocm-systems#2516);
- ``hipMemUnmap`` of anything but exactly one mapping (ROCm/ROCR-Runtime#285);
- sizes and addresses that are not multiples of the minimum granularity, frees of reservations that still hold
  mappings, releases of unknown handles.

A refused call returns ``hipErrorInvalidValue`` (as HIP would), so the driver under test raises ``DriverError``.

Every call is recorded in ``calls`` in order. ``fail(name, nth, error)`` makes the ``nth`` next call of ``name``
return ``error`` without touching the model. ``hipMemSetAccess`` is recorded with its descriptor array decoded
(``((location type, location id, flags), ...)``) in place of the address the driver passed.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass, field
from typing import Any

KIB = 1 << 10
MIB = 1 << 20
VA_BASE = 0x7F00_0000_0000

_GARBAGE = object()  # what malloc leaves in a field nobody set


class hipError_t(enum.IntEnum):  # hip-python's names
    hipSuccess = 0
    hipErrorInvalidValue = 1
    hipErrorOutOfMemory = 2
    hipErrorNotInitialized = 3
    hipErrorNoDevice = 100
    hipErrorInvalidDevice = 101
    hipErrorNotSupported = 801


class hipMemAllocationType(enum.IntEnum):
    hipMemAllocationTypeInvalid = 0
    hipMemAllocationTypePinned = 1


class hipMemAllocationHandleType(enum.IntEnum):
    hipMemHandleTypeNone = 0
    hipMemHandleTypePosixFileDescriptor = 1


class hipMemLocationType(enum.IntEnum):
    hipMemLocationTypeInvalid = 0
    hipMemLocationTypeDevice = 1
    hipMemLocationTypeHost = 2


class hipMemLocationTypeWithoutHost(enum.IntEnum):  # older bindings: no Host location
    hipMemLocationTypeInvalid = 0
    hipMemLocationTypeDevice = 1


class hipMemAccessFlags(enum.IntEnum):
    hipMemAccessFlagsProtNone = 0
    hipMemAccessFlagsProtRead = 1
    hipMemAccessFlagsProtReadWrite = 3


class hipMemAllocationGranularity_flags(enum.IntEnum):
    hipMemAllocationGranularityMinimum = 0
    hipMemAllocationGranularityRecommended = 1


class hipDeviceAttribute_t(enum.IntEnum):
    hipDeviceAttributeVirtualMemoryManagementSupported = 89
    hipDeviceAttributeIsLargeBar = 10011


LOCATION_DEVICE = int(hipMemLocationType.hipMemLocationTypeDevice)
LOCATION_HOST = int(hipMemLocationType.hipMemLocationTypeHost)
READ_WRITE = int(hipMemAccessFlags.hipMemAccessFlagsProtReadWrite)


def _enum_setter(name: str, enum_name: str):
    """A property that, like hip-python's setters, takes only members of the enum called ``enum_name``."""

    def get(self):
        return getattr(self, "_" + name)

    def set_(self, value):
        if not isinstance(value, enum.IntEnum) or not type(value).__name__.startswith(enum_name):
            raise TypeError(f"'value' must be of type '{enum_name}', got {type(value).__name__} {value!r}")
        setattr(self, "_" + name, value)

    return property(get, set_)


def _int_setter(name: str):
    def get(self):
        return getattr(self, "_" + name)

    def set_(self, value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        setattr(self, "_" + name, value)

    return property(get, set_)


class _Struct:
    FIELDS: tuple[str, ...] = ()
    NESTED: tuple[str, ...] = ()

    def __init__(self) -> None:
        for name in self.FIELDS:
            setattr(self, "_" + name, _GARBAGE)

    def garbage_fields(self, prefix: str = "") -> list[str]:
        """Fields never set (what would be malloc garbage in hip-python), nested structs included."""
        out = [prefix + n for n in self.FIELDS if getattr(self, "_" + n) is _GARBAGE]
        for n in self.NESTED:
            out += getattr(self, n).garbage_fields(prefix + n + ".")
        return out


class hipMemLocation(_Struct):
    FIELDS = ("type", "id")
    type = _enum_setter("type", "hipMemLocationType")
    id = _int_setter("id")


class hipMemAllocationProp_struct_0(_Struct):
    FIELDS = ("compressionType", "gpuDirectRDMACapable", "usage")
    compressionType = _int_setter("compressionType")
    gpuDirectRDMACapable = _int_setter("gpuDirectRDMACapable")
    usage = _int_setter("usage")


class hipMemAllocationProp(_Struct):
    FIELDS = ("type", "requestedHandleType", "win32HandleMetaData")
    NESTED = ("location", "allocFlags")
    type = _enum_setter("type", "hipMemAllocationType")
    requestedHandleType = _enum_setter("requestedHandleType", "hipMemAllocationHandleType")

    def __init__(self) -> None:
        super().__init__()
        self._location = hipMemLocation()
        self._alloc_flags = hipMemAllocationProp_struct_0()

    @property
    def location(self) -> hipMemLocation:
        return self._location

    @property
    def allocFlags(self) -> hipMemAllocationProp_struct_0:
        return self._alloc_flags

    @property
    def win32HandleMetaData(self):
        return self._win32HandleMetaData

    @win32HandleMetaData.setter
    def win32HandleMetaData(self, value) -> None:
        if value is not None and not isinstance(value, int):
            raise TypeError(f"win32HandleMetaData takes a pointer (None or int), got {value!r}")
        self._win32HandleMetaData = value


class FakePointer:
    """What hip-python's ``hipMemAddressReserve`` returns: an adapter whose ``int()`` is the address."""

    __slots__ = ("_address",)

    def __init__(self, address: int) -> None:
        self._address = address

    def __int__(self) -> int:
        return self._address

    def __repr__(self) -> str:
        return f"<FakePointer {self._address:#x}>"


@dataclass(eq=False)
class FakeHandle:
    """A physical allocation. ``released``: ``hipMemRelease`` was called; the memory lives while mapped."""

    serial: int
    size: int
    released: bool = False

    def __repr__(self) -> str:
        return f"<FakeHandle #{self.serial} {self.size} bytes{' released' if self.released else ''}>"


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AccessDesc(ctypes.Structure):  # the C layout of hipMemAccessDesc, written down independently of the driver
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@dataclass
class _Fault:
    left: int
    error: hipError_t


@dataclass
class FakeHip:
    """A stand-in for ``hip.hip`` (see the module docstring). Keyword fields configure the device it pretends."""

    recommended: int = 2 * MIB
    minimum: int = 4 * KIB
    devices: int = 1
    vmm: bool = True
    large_bar: bool = False
    host_location: bool = True
    access_per_mapping: bool = True
    ignore_alignment: bool = False
    init_error: hipError_t = hipError_t.hipSuccess
    init_raises: BaseException | None = None
    total_bytes: int = 192 << 30
    current_device: int = 0
    calls: list[Call] = field(default_factory=list)
    reservations: dict[int, int] = field(default_factory=dict)  # va -> size
    handles: list[FakeHandle] = field(default_factory=list)  # every handle ever created
    mappings: dict[int, tuple[int, FakeHandle]] = field(default_factory=dict)  # va -> (size, handle)
    access: dict[int, dict[tuple[int, int], int]] = field(default_factory=dict)  # mapping va -> {(type, id): flags}

    hipError_t = hipError_t
    hipMemAllocationType = hipMemAllocationType
    hipMemAllocationHandleType = hipMemAllocationHandleType
    hipMemAccessFlags = hipMemAccessFlags
    hipMemAllocationGranularity_flags = hipMemAllocationGranularity_flags
    hipDeviceAttribute_t = hipDeviceAttribute_t
    hipMemAllocationProp = hipMemAllocationProp
    hipMemLocation = hipMemLocation

    def __post_init__(self) -> None:
        self.hipMemLocationType = hipMemLocationType if self.host_location else hipMemLocationTypeWithoutHost
        self._faults: dict[str, _Fault] = {}
        self._next_va = VA_BASE

    # -- test controls ------------------------------------------------------------------------------------------
    def fail(self, name: str, nth: int = 1, error: hipError_t = hipError_t.hipErrorInvalidValue) -> None:
        """Make the ``nth`` next call of ``name`` (a hip function name) return ``error``."""
        if not callable(getattr(self, name, None)) or not name.startswith("hip"):
            raise ValueError(f"FakeHip has no function {name!r}")
        self._faults[name] = _Fault(nth, error)

    def calls_of(self, name: str, since: int = 0) -> list[Call]:
        return [c for c in self.calls[since:] if c.name == name]

    def count(self, name: str, since: int = 0) -> int:
        return len(self.calls_of(name, since))

    def live_handles(self) -> list[FakeHandle]:
        """Handles created and not yet released."""
        return [h for h in self.handles if not h.released]

    def outstanding(self) -> dict[str, Any]:
        """Everything still held: an empty dict of empties means nothing leaked."""
        return {
            "reservations": dict(self.reservations),
            "live handles": self.live_handles(),
            "mappings": {va: size for va, (size, _) in self.mappings.items()},
        }

    # -- plumbing -----------------------------------------------------------------------------------------------
    def _enter(self, name: str, *args: Any) -> hipError_t | None:
        self.calls.append(Call(name, args))
        fault = self._faults.get(name)
        if fault is None:
            return None
        fault.left -= 1
        if fault.left:
            return None
        del self._faults[name]
        return fault.error

    def _aligned(self, *values: int) -> bool:
        return all(isinstance(v, int) and v >= 0 and v % self.minimum == 0 for v in values)

    def _in_one_reservation(self, va: int, size: int) -> bool:
        return any(r <= va and va + size <= r + s for r, s in self.reservations.items())

    @staticmethod
    def _address(ptr: Any) -> int:
        if isinstance(ptr, FakePointer):
            return int(ptr)
        if isinstance(ptr, bool) or not isinstance(ptr, int):
            raise TypeError(f"FakeHip takes addresses as int (or its own pointer objects), got {ptr!r}")
        return ptr

    # -- initialisation and devices -------------------------------------------------------------------------------
    def hipInit(self, flags: int):
        if self.init_raises is not None:
            raise self.init_raises
        return (self._enter("hipInit", flags) or self.init_error,)

    def hipGetDeviceCount(self):
        err = self._enter("hipGetDeviceCount")
        if err:
            return err, 0
        if self.devices == 0:
            return hipError_t.hipErrorNoDevice, 0
        return hipError_t.hipSuccess, self.devices

    def hipDeviceGetAttribute(self, attr: Any, device: int):
        err = self._enter("hipDeviceGetAttribute", attr, device)
        if err:
            return err, 0
        if not isinstance(attr, hipDeviceAttribute_t):
            raise TypeError(f"argument 'attr' must be a hipDeviceAttribute_t, got {attr!r}")
        if not 0 <= device < self.devices:
            return hipError_t.hipErrorInvalidDevice, 0
        if attr is hipDeviceAttribute_t.hipDeviceAttributeVirtualMemoryManagementSupported:
            return hipError_t.hipSuccess, int(self.vmm)
        return hipError_t.hipSuccess, int(self.large_bar)

    def hipGetDevice(self):
        return self._enter("hipGetDevice") or hipError_t.hipSuccess, self.current_device

    def hipSetDevice(self, device: int):
        err = self._enter("hipSetDevice", device)
        if err:
            return (err,)
        if not 0 <= device < self.devices:
            return (hipError_t.hipErrorInvalidDevice,)
        self.current_device = device
        return (hipError_t.hipSuccess,)

    def hipDeviceSynchronize(self):
        return (self._enter("hipDeviceSynchronize") or hipError_t.hipSuccess,)

    def hipMemGetInfo(self):
        err = self._enter("hipMemGetInfo")
        if err:
            return err, 0, 0
        used = sum(h.size for h in self.handles if not h.released or self._is_mapped(h))
        return hipError_t.hipSuccess, self.total_bytes - used, self.total_bytes

    def _is_mapped(self, handle: FakeHandle) -> bool:
        return any(h is handle for _, h in self.mappings.values())

    # -- virtual memory -------------------------------------------------------------------------------------------
    def hipMemGetAllocationGranularity(self, prop: Any, option: Any):
        err = self._enter("hipMemGetAllocationGranularity", prop, option)
        if err:
            return err, 0
        if not isinstance(option, hipMemAllocationGranularity_flags):
            raise TypeError("argument 'option' must be of type '_hipMemAllocationGranularity_flags__Base'")
        if not isinstance(prop, hipMemAllocationProp) or prop.garbage_fields():
            return hipError_t.hipErrorInvalidValue, 0
        if option is hipMemAllocationGranularity_flags.hipMemAllocationGranularityRecommended:
            return hipError_t.hipSuccess, self.recommended
        return hipError_t.hipSuccess, self.minimum

    def hipMemAddressReserve(self, size: int, alignment: int, addr: Any, flags: int):
        err = self._enter("hipMemAddressReserve", size, alignment, addr, flags)
        if err:
            return err, FakePointer(0)
        if not self._aligned(size) or size == 0 or flags != 0 or alignment < 0 or (alignment & (alignment - 1)):
            return hipError_t.hipErrorInvalidValue, FakePointer(0)
        align = max(alignment, self.minimum)
        va = -(-self._next_va // align) * align
        if self.ignore_alignment and alignment > self.minimum:
            va += self.minimum  # a runtime that ignores the requested alignment
        self._next_va = va + size + 64 * MIB  # leave a gap so neighbours are never adjacent
        self.reservations[va] = size
        return hipError_t.hipSuccess, FakePointer(va)

    def hipMemAddressFree(self, ptr: Any, size: int):
        va = self._address(ptr)
        err = self._enter("hipMemAddressFree", va, size)
        if err:
            return (err,)
        if self.reservations.get(va) != size or any(va <= m < va + size for m in self.mappings):
            return (hipError_t.hipErrorInvalidValue,)
        del self.reservations[va]
        return (hipError_t.hipSuccess,)

    def hipMemCreate(self, size: int, prop: Any, flags: int):
        err = self._enter("hipMemCreate", size, prop, flags)
        if err:
            return err, None
        if not isinstance(prop, hipMemAllocationProp) or prop.garbage_fields() or flags != 0:
            return hipError_t.hipErrorInvalidValue, None
        if (
            prop.type is not hipMemAllocationType.hipMemAllocationTypePinned
            or int(prop.location.type) != LOCATION_DEVICE
            or not 0 <= prop.location.id < self.devices
        ):
            return hipError_t.hipErrorInvalidValue, None
        if not self._aligned(size) or size == 0:
            return hipError_t.hipErrorInvalidValue, None
        handle = FakeHandle(len(self.handles) + 1, size)
        self.handles.append(handle)
        return hipError_t.hipSuccess, handle

    def hipMemRelease(self, handle: Any):
        err = self._enter("hipMemRelease", handle)
        if err:
            return (err,)
        if not isinstance(handle, FakeHandle) or handle.released or handle not in self.handles:
            return (hipError_t.hipErrorInvalidValue,)
        handle.released = True
        return (hipError_t.hipSuccess,)

    def hipMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int):
        va = self._address(ptr)
        err = self._enter("hipMemMap", va, size, offset, handle, flags)
        if err:
            return (err,)
        if offset != 0 or flags != 0:  # ROCm: "offset into the memory, currently must be zero"
            return (hipError_t.hipErrorInvalidValue,)
        if not isinstance(handle, FakeHandle) or handle.released or size > handle.size:
            return (hipError_t.hipErrorInvalidValue,)
        if not self._aligned(va, size) or size == 0 or not self._in_one_reservation(va, size):
            return (hipError_t.hipErrorInvalidValue,)
        if any(m < va + size and va < m + s for m, (s, _) in self.mappings.items()):
            return (hipError_t.hipErrorInvalidValue,)
        self.mappings[va] = (size, handle)
        self.access[va] = {}
        return (hipError_t.hipSuccess,)

    def hipMemUnmap(self, ptr: Any, size: int):
        va = self._address(ptr)
        err = self._enter("hipMemUnmap", va, size)
        if err:
            return (err,)
        live = self.mappings.get(va)
        if live is None or live[0] != size:  # ROCR-Runtime#285: one unmap per mapping
            return (hipError_t.hipErrorInvalidValue,)
        del self.mappings[va]
        del self.access[va]
        return (hipError_t.hipSuccess,)

    def hipMemSetAccess(self, ptr: Any, size: int, desc: Any, count: int):
        va = self._address(ptr)
        if isinstance(desc, bool) or not isinstance(desc, int) or not desc or count <= 0:
            raise TypeError(f"FakeHip.hipMemSetAccess takes the address of a hipMemAccessDesc array, got {desc!r}")
        descs = tuple((d.location.type, d.location.id, d.flags) for d in (_AccessDesc * count).from_address(desc))
        err = self._enter("hipMemSetAccess", va, size, descs, count)
        if err:
            return (err,)
        inside = sorted((m, s) for m, (s, _) in self.mappings.items() if m < va + size and va < m + s)
        covered = sum(min(m + s, va + size) - max(m, va) for m, s in inside)
        if not self._aligned(va, size) or size == 0 or covered != size:
            return (hipError_t.hipErrorInvalidValue,)
        if self.access_per_mapping and inside != [(va, size)]:  # rocm-systems#2516
            return (hipError_t.hipErrorInvalidValue,)
        for kind, ident, _flags in descs:
            if kind not in (LOCATION_DEVICE, LOCATION_HOST) or (
                kind == LOCATION_DEVICE and not 0 <= ident < self.devices
            ):
                return (hipError_t.hipErrorInvalidValue,)
            if kind == LOCATION_HOST and not self.host_location:
                return (hipError_t.hipErrorInvalidValue,)
        for m, _ in inside:
            for kind, ident, flags in descs:
                self.access[m][(kind, ident)] = flags
        return (hipError_t.hipSuccess,)

    def hipMemGetAccess(self, location: Any, ptr: Any):
        va = self._address(ptr)
        if isinstance(location, bool) or not isinstance(location, int) or not location:
            raise TypeError(f"FakeHip.hipMemGetAccess takes the address of a hipMemLocation, got {location!r}")
        loc = _Location.from_address(location)
        err = self._enter("hipMemGetAccess", (loc.type, loc.id), va)
        if err:
            return err, 0
        for m, (s, _) in self.mappings.items():
            if m <= va < m + s:
                return hipError_t.hipSuccess, self.access[m].get((loc.type, loc.id), 0)
        return hipError_t.hipErrorInvalidValue, 0

    def hipMemsetD8Async(self, dest: Any, value: int, count: int, stream: Any):
        va = self._address(dest)
        err = self._enter("hipMemsetD8Async", va, value, count, stream)
        if err:
            return (err,)
        end, cursor = va + count, va
        for m, (s, _) in sorted(self.mappings.items()):
            if m <= cursor < m + s:
                if self.access[m].get((LOCATION_DEVICE, self.current_device), 0) != READ_WRITE:
                    return (hipError_t.hipErrorInvalidValue,)
                cursor = m + s
        if cursor < end:
            return (hipError_t.hipErrorInvalidValue,)
        return (hipError_t.hipSuccess,)
