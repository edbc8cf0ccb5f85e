"""The HIP driver: ``hipMem*`` virtual memory calls on AMD GPUs through hip-python (``from hip import hip``).

==========================  =========================================================================
protocol operation          HIP runtime call
==========================  =========================================================================
``granularity``             ``hipMemGetAllocationGranularity(Recommended)`` (a multiple of Minimum)
``reserve`` / ``free``      ``hipMemAddressReserve`` / ``hipMemAddressFree``
``create`` / ``release``    ``hipMemCreate`` (pinned, device-located) / ``hipMemRelease``
``map`` / ``unmap``         ``hipMemMap`` (offset 0 only) / ``hipMemUnmap`` (exactly one mapping)
``set_access``              ``hipMemSetAccess`` once per mapping in the range (device, plus host on large BAR)
``zero``                    ``hipMemsetD8Async`` on torch's current stream
``accessible``              ``hipMemGetAccess``
``synchronize``             ``hipDeviceSynchronize``
``mem_info``                ``hipMemGetInfo``
==========================  =========================================================================

Tensors are torch ROCm tensors (torch calls HIP devices ``cuda``) built from ``__cuda_array_interface__``, which
torch keeps alive (and with it the keeper) for the storage's lifetime. HIP VMM is Linux-only and marked Beta by
AMD (https://rocm.docs.amd.com/projects/HIP/en/docs-6.1.2/reference/virtual_memory_reference.html); each Note below
links the report behind the quirk it handles.

Every binding call goes through ``_bindings()``, so the unit tests (``tests/unit/test_hip_driver.py``)
substitute a recording fake of ``hip.hip`` and run all of this on a CPU.

Note [hipMemMap offset]
    ``hipMemMap``'s offset "currently must be zero"
    (https://rocm.docs.amd.com/projects/hipfort/en/develop/doxygen/html/interfacehipfort_1_1hipmemmap.html). The
    protocol allows an offset into a handle; this driver refuses any other offset with ``DriverError`` before
    calling HIP, so the error names the rule instead of surfacing as ``hipErrorInvalidValue``. ``ExtensibleTensor``
    always maps whole handles at offset 0.

Note [Granularity]
    The driver asks for the Recommended granularity and never assumes a value. ROCm reports different figures per
    device: gfx942 (MI300X) device pools show a 4 KiB minimum and a 2 MiB recommended granule, MI300A pools 4 KiB
    for both (https://github.com/ROCm/hip/issues/3716, https://github.com/ROCm/amdgpu/issues/186). The Minimum
    divides the Recommended one, so every size and address the callers derive from ``granularity()`` is valid.

Note [Chunked handles]
    Large ``hipMemCreate`` allocations misbehave on ROCm: vLLM's cumem allocator and torch_memory_saver create
    physical memory in chunks of 256 MiB (``VLLM_SLEEP_MEM_CHUNK_SIZE`` in
    https://github.com/vllm-project/vllm/blob/main/csrc/cumem_allocator.cpp; following vllm-project/vllm#12695,
    https://github.com/fzyzcjy/torch_memory_saver/pull/14, which also reports that ROCm 6.4.0 fails to release
    large handles). ``max_handle_bytes`` is therefore ``HANDLE_CHUNK_BYTES`` (256 MiB) rounded down to a multiple
    of the granularity (at least one granule), and ``ExtensibleTensor`` splits every run of new granules into
    handles no larger than that.

Note [Access per mapping]
    ``hipMemSetAccess`` over a range made of several ``hipMemMap`` regions fails with ``hipErrorInvalidValue`` on
    some ROCm releases and sizes (https://github.com/ROCm/rocm-systems/issues/2516; fixes in
    https://github.com/ROCm/rocm-systems/pull/2568 and https://github.com/ROCm/rocm-systems/pull/6977, the latter
    for a tail range of one reservation among several, the "grow" pattern). With chunked handles one growth run is
    several mappings, so ``set_access(va, size)`` walks the driver's own record of its mappings and issues one
    ``hipMemSetAccess`` per mapping inside the range; a range that is not fully mapped is refused. If the k-th of
    those calls fails, the earlier mappings of the range keep their access: the caller's rollback unmaps them,
    which drops it.

Note [Host access on large BAR]
    On large-BAR devices (MI300X) PyTorch ROCm >= 7.2 reads scalars through a host pointer; VMM memory with
    device-only access then faults in the host process (SIGSEGV, no traceback). vLLM grants a second access
    descriptor with location Host on ROCm (https://github.com/vllm-project/vllm/pull/51369), which needs a runtime
    that accepts Host in ``hipMemSetAccess`` for device memory (https://github.com/ROCm/rocm-systems/pull/1606).
    ``host_access=None`` (the default) turns it on when ``hipDeviceAttributeIsLargeBar`` is non-zero and the
    bindings know ``hipMemLocationTypeHost``; ``True``/``False`` force it. ``HipDriver.host_access`` says what was
    decided. The host descriptor uses location id 0.

Note [Access descriptor array]
    ``hipMemSetAccess`` takes a C array of ``hipMemAccessDesc``. hip-python's struct wrappers each own a separate
    allocation, so two of them are not an array; the driver keeps the descriptors in a ctypes array with the C
    layout (``{ {int type; int id} location; int flags }``, enum values taken from the bindings) and passes its
    address, which hip-python accepts for any struct argument. ``hipMemGetAccess`` gets the address of the first
    descriptor's location the same way.

Note [Allocation properties]
    hip-python allocates struct wrappers with ``malloc``, not ``calloc``: a field that is not set holds garbage.
    ``hipMemAllocationProp`` is therefore filled field by field (handle type none, no Win32 metadata, zero
    allocation flags), not only type and location.

Note [Unmap per mapping]
    One ``hipMemUnmap`` over several mapped regions leaves use counts behind so that ``hipMemAddressFree`` fails
    later (https://github.com/ROCm/ROCR-Runtime/issues/285). The protocol already requires unmapping exactly one
    mapping; the driver checks it against its records and refuses anything else before calling HIP.

Note [Reserve alignment]
    The requested alignment is checked on the returned address. If HIP ignored it, the driver frees the range,
    reserves ``size + alignment`` instead and hands out the aligned address inside it; ``free`` returns the whole
    underlying reservation.

Note [Current device]
    HIP runtime calls act on the calling thread's current device (``hipMemAddressReserve`` reserves through it).
    Every call runs with ``ordinal`` current and restores the thread's previous device afterwards, so the driver
    neither depends on nor disturbs torch's choice of device on that thread.

Note [No use after fork] and Note [A call never waits on its own thread] in ``host`` hold here as written: every
call checks its process first, before any lock, and a call that takes the lock (``_LOCKING``) made by a thread
already inside one is refused with ``DriverError`` naming it. Each locked section is one line inside
``reaper.busy()`` and this thread's mark, as on the host (Note [Locked sections are one line] in ``reaper``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import DriverError, DriverOutOfMemory, DriverUnavailable
from ..reaper import busy
from ._device_array import DeviceArray
from .records import (
    check_entry,
    check_free,
    check_inside,
    check_no_overlap,
    check_one_mapping,
    check_range,
    mapped_parts,
    thread_mark,
)

HANDLE_CHUNK_BYTES = 256 << 20
"""Largest physical handle asked of HIP before rounding to the granularity; see Note [Chunked handles]."""

_OOM_NAMES = ("hipErrorOutOfMemory", "hipErrorMemoryAllocation")
_LOCKING = frozenset({"reserve", "free", "map", "unmap", "set_access"})
"""The calls that take the driver's lock: Note [A call never waits on its own thread] in ``host``."""


def _bindings() -> Any:
    """hip-python's ``hip.hip`` module: the single point every binding access goes through."""
    from hip import hip  # optional dependency

    return hip


def _torch_reason(ordinal: int) -> str | None:
    """Why torch cannot hand out ROCm tensors on device ``ordinal``, or ``None``."""
    hip_version = getattr(torch.version, "hip", None)
    if not hip_version:
        return (
            f"torch {torch.__version__} was built without ROCm (torch.version.hip is None); install a ROCm "
            f"build of torch"
        )
    if not torch.cuda.is_available() or torch.cuda.device_count() <= ordinal:
        return f"torch (ROCm {hip_version}) cannot see HIP device {ordinal}"
    return None


def probe(ordinal: int = 0) -> str | None:
    """Return why the HIP driver cannot run here, or ``None`` when it can."""
    try:  # libamdhip64.so missing: hip-python cannot load the runtime, on import or on the first call
        try:
            hip = _bindings()
        except ImportError as exc:
            return f"hip-python is not installed ({exc}); install the 'rocm' extra (pip install -e .[rocm])"
        ok = hip.hipError_t.hipSuccess
        (err,) = hip.hipInit(0)
    except (OSError, RuntimeError) as exc:
        return f"the HIP runtime library (libamdhip64.so) could not be loaded ({exc})"
    if err != ok:
        return f"hipInit failed: {_name(err)} (no ROCm driver, or no AMD GPU visible to this process)"
    err, count = hip.hipGetDeviceCount()
    if err != ok or count <= ordinal:
        return f"no HIP device {ordinal} (found {count if err == ok else 0})"
    attr = getattr(hip.hipDeviceAttribute_t, "hipDeviceAttributeVirtualMemoryManagementSupported", None)
    if attr is None:
        return "these hip-python bindings lack hipDeviceAttributeVirtualMemoryManagementSupported; upgrade hip-python"
    err, supported = hip.hipDeviceGetAttribute(attr, ordinal)
    if err != ok or not supported:
        return (
            f"HIP device {ordinal} does not support virtual memory management "
            f"(hipDeviceAttributeVirtualMemoryManagementSupported is "
            f"{_name(err) if err != ok else supported})"
        )
    return _torch_reason(ordinal)


def _name(err: Any) -> str:
    return getattr(err, "name", str(err))


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemAccessDesc(ctypes.Structure):
    """C layout of ``hipMemAccessDesc``; see Note [Access descriptor array]."""

    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_uint)]


class HipDriver:
    """VMM on an AMD GPU through hip-python (see the module docstring).

    ``host_access``: grant the host read-write access to mapped memory too (Note [Host access on large BAR]);
    ``None`` decides from the device's large-BAR attribute.
    """

    def __init__(self, ordinal: int = 0, *, name: str = "hip", host_access: bool | None = None) -> None:
        reason = probe(ordinal)
        if reason:
            raise DriverUnavailable(reason)
        self.name = name
        self.ordinal = ordinal
        self.device = torch.device("cuda", ordinal)  # torch's ROCm build names HIP devices "cuda"
        self._hip = hip = _bindings()
        self._lock = threading.Lock()
        self._marks = threading.local()  # Note [A call never waits on its own thread] in ``host``
        self._pid = os.getpid()
        self._reservations: dict[int, tuple[int, int, int]] = {}  # va -> (size, raw va, raw size)
        self._mappings: dict[int, int] = {}  # va -> size; Notes [Access per mapping], [Unmap per mapping]
        self._prop = self._allocation_prop()
        flag = hip.hipMemAllocationGranularity_flags.hipMemAllocationGranularityRecommended
        granularity = int(self._call("granularity", "hipMemGetAllocationGranularity", self._prop, flag))
        if granularity <= 0:
            raise DriverError("granularity", f"hipMemGetAllocationGranularity returned {granularity}")
        self._granularity = granularity
        self.max_handle_bytes: int | None = max(HANDLE_CHUNK_BYTES // granularity, 1) * granularity
        self.host_access = self._decide_host_access(host_access)
        self._access = self._access_descriptors()

    def __repr__(self) -> str:
        return (
            f"HipDriver(ordinal={self.ordinal}, granularity={self._granularity}, "
            f"max_handle_bytes={self.max_handle_bytes}, host_access={self.host_access})"
        )

    # -- protocol ---------------------------------------------------------------------------------------------
    def granularity(self) -> int:
        self._enter("granularity")
        return self._granularity

    def reserve(self, size: int, alignment: int) -> int:  # Note [Reserve alignment]
        self._enter("reserve", size=size, alignment=alignment)
        va = int(self._call("reserve", "hipMemAddressReserve", size, alignment, 0, 0))
        raw, raw_size = va, size
        if alignment > 1 and va % alignment:
            self._call("reserve", "hipMemAddressFree", va, size)
            raw_size = size + alignment
            raw = int(self._call("reserve", "hipMemAddressReserve", raw_size, alignment, 0, 0))
            va = -(-raw // alignment) * alignment
        with busy(), thread_mark(self._marks), self._lock: self._reservations[va] = (size, raw, raw_size)  # fmt: skip
        return va

    def free(self, va: int, size: int) -> None:
        self._enter("free", va=va, size=size)
        # records and native call together: a call from another thread sees both or neither
        with busy(), thread_mark(self._marks), self._lock: return self._free(va, size)  # fmt: skip

    def _free(self, va: int, size: int) -> None:
        entry = self._reservations.get(va)
        check_free(va, size, entry is not None and entry[0] == size, self._mappings)
        assert entry is not None  # check_free refused an unknown reservation
        _, raw, raw_size = entry
        self._call("free", "hipMemAddressFree", raw, raw_size)
        del self._reservations[va]

    def create(self, size: int) -> Any:
        self._enter("create", size=size)
        return self._call("create", "hipMemCreate", size, self._prop, 0)

    def release(self, handle: Any) -> None:
        self._enter("release")
        self._call("release", "hipMemRelease", handle)

    def map(self, va: int, size: int, handle: Any, offset: int = 0) -> None:
        self._enter("map", va=va, size=size, offset=offset)
        if offset != 0:  # Note [hipMemMap offset]
            raise DriverError(
                "map",
                f"hipMemMap offset must be 0 on ROCm, got offset={offset} for "
                f"[{va:#x}, +{size}); map whole handles (Note [hipMemMap offset])",
            )
        with busy(), thread_mark(self._marks), self._lock: return self._map(va, size, handle)  # fmt: skip

    def _map(self, va: int, size: int, handle: Any) -> None:
        check_inside("map", va, size, ((r, entry[0]) for r, entry in self._reservations.items()))
        check_no_overlap(va, size, self._mappings.items())
        self._call("map", "hipMemMap", va, size, 0, handle, 0)
        self._mappings[va] = size

    def unmap(self, va: int, size: int) -> None:  # Note [Unmap per mapping]
        self._enter("unmap", va=va, size=size)
        with busy(), thread_mark(self._marks), self._lock: return self._unmap(va, size)  # fmt: skip

    def _unmap(self, va: int, size: int) -> None:
        check_one_mapping(va, size, self._mappings.get(va))
        self._call("unmap", "hipMemUnmap", va, size)
        del self._mappings[va]

    def set_access(self, va: int, size: int) -> None:  # Note [Access per mapping]
        self._enter("set_access", va=va, size=size)
        with busy(), thread_mark(self._marks), self._lock: return self._set_access(va, size)  # fmt: skip

    def _set_access(self, va: int, size: int) -> None:
        parts = mapped_parts(va, size, self._mappings.items())
        address = ctypes.addressof(self._access)
        for lo, hi in parts:
            self._call("set_access", "hipMemSetAccess", lo, hi - lo, address, len(self._access))

    def zero(self, va: int, size: int) -> None:
        self._enter("zero", va=va, size=size)
        self._call("zero", "hipMemsetD8Async", va, 0, size, self._current_stream())

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self._enter("tensor", va=va, size=nbytes)
        return torch.as_tensor(DeviceArray(va, nbytes, keeper), device=self.device)

    def accessible(self, va: int) -> bool:
        self._enter("accessible", va=va)
        hip = self._hip
        with self._on_device():
            err, flags = hip.hipMemGetAccess(ctypes.addressof(self._access[0].location), va)
        if err != hip.hipError_t.hipSuccess:
            return False
        return int(flags) == int(hip.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite)

    def synchronize(self) -> None:
        self._enter("synchronize")
        self._call("synchronize", "hipDeviceSynchronize")

    def mem_info(self) -> tuple[int, int]:
        self._enter("mem_info")
        free, total = self._call("mem_info", "hipMemGetInfo")
        return int(free), int(total)

    # -- helpers -----------------------------------------------------------------------------------------------
    def _enter(self, op: str, **values: int) -> None:
        """What every call checks first, before any lock: its process, its thread (``records.check_entry``), its
        values (``check_range``)."""
        check_entry(op, self.name, self._pid, self._marks, op in _LOCKING, values)
        check_range(op, **values)

    def _current_stream(self) -> int:
        """torch's current stream on the device, as the integer hipStream_t hip-python accepts."""
        return torch.cuda.current_stream(self.device).cuda_stream

    def _allocation_prop(self) -> Any:  # Note [Allocation properties]
        hip = self._hip
        prop = hip.hipMemAllocationProp()
        prop.type = hip.hipMemAllocationType.hipMemAllocationTypePinned
        prop.requestedHandleType = hip.hipMemAllocationHandleType.hipMemHandleTypeNone
        prop.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        prop.location.id = self.ordinal
        prop.win32HandleMetaData = None
        prop.allocFlags.compressionType = 0
        prop.allocFlags.gpuDirectRDMACapable = 0
        prop.allocFlags.usage = 0
        return prop

    def _decide_host_access(self, requested: bool | None) -> bool:  # Note [Host access on large BAR]
        hip = self._hip
        has_host = hasattr(hip.hipMemLocationType, "hipMemLocationTypeHost")
        if requested is not None:
            if requested and not has_host:
                raise DriverUnavailable(
                    "host_access=True, but these hip-python bindings have no "
                    "hipMemLocationTypeHost; upgrade hip-python and ROCm"
                )
            return bool(requested)
        attr = getattr(hip.hipDeviceAttribute_t, "hipDeviceAttributeIsLargeBar", None)
        if not has_host or attr is None:
            return False
        with self._on_device():
            err, large_bar = hip.hipDeviceGetAttribute(attr, self.ordinal)
        return err == hip.hipError_t.hipSuccess and bool(large_bar)

    def _access_descriptors(self) -> ctypes.Array:  # Note [Access descriptor array]
        hip = self._hip
        read_write = int(hip.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite)
        entries = [(int(hip.hipMemLocationType.hipMemLocationTypeDevice), self.ordinal)]
        if self.host_access:
            entries.append((int(hip.hipMemLocationType.hipMemLocationTypeHost), 0))
        descs = (_MemAccessDesc * len(entries))()
        for desc, (kind, ident) in zip(descs, entries):
            desc.location.type, desc.location.id, desc.flags = kind, ident, read_write
        return descs

    @contextmanager
    def _on_device(self) -> Iterator[None]:  # Note [Current device]
        hip = self._hip
        err, previous = hip.hipGetDevice()
        switch = err == hip.hipError_t.hipSuccess and previous != self.ordinal
        if switch:
            self._check("hipSetDevice", hip.hipSetDevice(self.ordinal))
        try:
            yield
        finally:
            if switch:
                hip.hipSetDevice(previous)

    def _call(self, op: str, fn: str, *args: Any) -> Any:
        with self._on_device():
            result = getattr(self._hip, fn)(*args)
        return self._check(fn, result, op, args)

    def _check(self, fn: str, result: tuple, op: str | None = None, args: tuple = ()) -> Any:
        err, *values = result
        if err != self._hip.hipError_t.hipSuccess:
            shown = ", ".join(
                hex(a) if isinstance(a, int) and a > 1 << 20 else str(a)
                for a in args
                if isinstance(a, (int, str)) or a is None
            )
            kind = DriverOutOfMemory if _name(err) in _OOM_NAMES else DriverError
            hint = (
                " (host access is on: pass host_access=False if this ROCm rejects it)"
                if fn == "hipMemSetAccess" and getattr(self, "host_access", False)
                else ""
            )
            raise kind(op or fn, f"{fn}({shown}) returned {_name(err)}{hint}", int(err))
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)
