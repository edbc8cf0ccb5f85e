"""The CUDA driver: ``cuMem*`` virtual memory calls through cuda-bindings (``cuda.bindings.driver``).

==========================  =========================================================================
protocol operation          CUDA driver call
==========================  =========================================================================
``granularity``             ``cuMemGetAllocationGranularity(RECOMMENDED)`` (a multiple of MINIMUM)
``reserve`` / ``free``      ``cuMemAddressReserve`` / ``cuMemAddressFree``
``create`` / ``release``    ``cuMemCreate`` (pinned, device-located) / ``cuMemRelease``
``map`` / ``unmap``         ``cuMemMap`` / ``cuMemUnmap``
``set_access``              ``cuMemSetAccess`` (read-write for the owning device)
``zero``                    ``cuMemsetD8Async`` on torch's current stream
``accessible``              ``cuMemGetAccess``
``mem_info``                ``cuMemGetInfo``
==========================  =========================================================================

Tensors are torch CUDA tensors built from ``__cuda_array_interface__``; torch keeps the interface object (and with
it the keeper) alive for the storage's lifetime, so no DLPack deleter of ours ever runs.

Note [Why not cuda.core.VirtualMemoryResource]
    Its ``modify_allocation`` grows a buffer by asking the driver for the address range right after it and, when
    refused, reserves a new range and moves the pointer. Captured CUDA graphs hold raw addresses, so a moved base
    breaks them; we reserve the upper bound once instead and only ever map inside it.

Note [Current context]
    cuda-bindings calls act on the calling thread's current context. torch uses the device's primary context, so
    every entry point makes the primary context of ``device`` current first (retaining it once). Calls from a
    thread on which torch never ran would otherwise fail with CUDA_ERROR_INVALID_CONTEXT.

Note [Granularity]
    The driver asks for the RECOMMENDED granularity (2 MiB on current NVIDIA GPUs; never assumed). Sizes,
    addresses and offsets must be multiples of the MINIMUM, which divides the recommended one.

Note [accessible() probes unmapped addresses]
    ``cuMemGetAccess`` on an address with nothing mapped returns CUDA_ERROR_INVALID_VALUE; ``accessible`` reads that
    as "not accessible", which is how the conformance rules check that nothing is left mapped. compute-sanitizer
    reports every such call as an API error (on the H200, 2026-12-02: 364 in a memcheck run of the conformance
    rules; the 200 it printed were these probes and two deliberately refused double ``cuMemMap`` calls), so memcheck
    runs use ``--report-api-errors no``; memory errors are still reported (0 for the same rules).

Note [cuMem accepts what the protocol refuses]
    On the H200 (driver 570, 2026-12-02) ``cuMemMap`` maps a range that runs past its reservation's end into the
    next reservation, and ``cuMemUnmap``/``cuMemSetAccess`` take ranges that span several mappings, a mapping and the
    next granule, or a gap; the protocol refuses all of these (a tensor that did them would unmap or expose its
    neighbour's memory). The driver keeps records of its reservations and mappings and refuses such calls itself,
    with the checks the host and HIP drivers use (``records.py``), before any native call.

Note [cuMemMap takes a released handle]
    On the H200 (2026-12-04) ``cuMemMap`` maps a handle after ``cuMemRelease`` while the handle is still mapped
    elsewhere (its memory is alive), where the protocol refuses a released handle (P-map-released). The driver keeps
    the handles it created and has not released, and refuses ``map`` and ``release`` of any other, as the host driver
    does. A handle whose memory is free again is gone: CUDA hands its value to a later ``cuMemCreate``, so a caller
    never passes it again (P-release-once).

Note [One lock over records and native calls]
    Every call that changes or depends on what is mapped runs its record check and its native call under one lock,
    so another thread's unmap or map of the same range cannot fall between them (the protocol's [P-threads]: calls
    are atomic). On the H200 (2026-12-04, ``reports/runs/h200-2026-12-04/``) the two-thread protocol rule, with
    ``cuMemSetAccess`` called after the lock was dropped, left ``cuMemSetAccess`` failing with
    CUDA_ERROR_ALREADY_MAPPED on later fresh mappings of the process, and 33 later rules of the same worker failed;
    the lock has covered ``cuMemSetAccess`` since. Each locked section is one line (Note [Locked sections are one
    line] in ``reaper``) and runs inside ``reaper.busy()`` and this thread's mark for this driver, as on the host.

Note [No use after fork] and Note [A call never waits on its own thread] in ``host`` hold here as written: every
call checks its process first, before any lock (a CUDA context is not usable after fork either), and a call that
takes the lock (``_LOCKING``) made by a thread already inside one is refused with ``DriverError`` naming it.

Note [Every call is whole, even when interrupted]
    As on the host (the note of that name in ``host``), an exception may land on any line: each call does all of
    its effect or none. Each native call's result tuple is stored by C (``got.extend(starmap(cuMemX, [args]))``,
    which takes any number of arguments, ``cuMemGetInfo``'s none included: Note [A result is stored by C] in
    ``host``), so the ``except`` clause knows whether CUDA did it: ``reserve``, ``create`` and ``map`` are then
    undone, ``free``, ``release`` and ``unmap`` (which cannot be) finish their records. The rule is
    ``conformance/test_interrupted_calls.py``; on a CPU, ``tests/unit/test_cuda_driver.py`` interrupts every line
    over a fake of cuda-bindings. On the H200 (2026-12-05, ``reports/runs/h200-2026-12-05b/``) ``check-driver cuda``
    passed 206 rules (8 skipped, 0 failed) in 59 s.
"""

from __future__ import annotations

import os
import threading
from itertools import starmap
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

_OOM_NAMES = ("CUDA_ERROR_OUT_OF_MEMORY",)
_LOCKING = frozenset({"reserve", "free", "create", "release", "map", "unmap", "set_access"})
"""The calls that take the driver's lock: Note [A call never waits on its own thread] in ``host``."""


def _bindings() -> Any:
    from cuda.bindings import driver  # optional dependency

    return driver


def probe(ordinal: int = 0) -> str | None:
    """Return why the CUDA driver cannot run here, or ``None`` when it can."""
    try:
        cu = _bindings()
    except ImportError as exc:
        return f"cuda-bindings is not installed ({exc}); install the 'cuda' extra"
    try:
        (err,) = cu.cuInit(0)
    except (RuntimeError, OSError) as exc:  # libcuda.so.1 missing: cuda-bindings cannot load the driver
        return f"the CUDA driver library could not be loaded ({exc})"
    if err != cu.CUresult.CUDA_SUCCESS:
        return f"cuInit failed: {err.name} (no NVIDIA driver or no device)"
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS or count <= ordinal:
        return f"no CUDA device {ordinal} (found {count if err == cu.CUresult.CUDA_SUCCESS else 0})"
    err, dev = cu.cuDeviceGet(ordinal)
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    err, supported = cu.cuDeviceGetAttribute(attr, dev)
    if err != cu.CUresult.CUDA_SUCCESS or not supported:
        return f"CUDA device {ordinal} does not support virtual memory management"
    if not torch.cuda.is_available():
        return "torch was built without CUDA or cannot see the device"
    return None


class CudaDriver:
    """VMM on an NVIDIA GPU through cuda-bindings (see the module docstring)."""

    max_handle_bytes: int | None = None

    def __init__(self, ordinal: int = 0, *, name: str = "cuda") -> None:
        reason = probe(ordinal)
        if reason:
            raise DriverUnavailable(reason)
        self.name = name
        self.ordinal = ordinal
        self.device = torch.device("cuda", ordinal)
        self._cu = cu = _bindings()
        torch.cuda.init()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._marks = threading.local()  # Note [A call never waits on its own thread] in ``host``
        self._pid = os.getpid()
        self._reservations: dict[int, int] = {}  # va -> size; Note [cuMem accepts what the protocol refuses]
        self._mappings: dict[int, int] = {}  # va -> size
        self._live: set[int] = set()  # handles created and not yet released: Note [cuMemMap takes a released handle]
        self._dev = self._check("cuDeviceGet", cu.cuDeviceGet(ordinal))
        self._ctx = self._check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self._dev))
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        self._prop = prop
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [desc]
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        self._granularity = int(self._call("granularity", "cuMemGetAllocationGranularity", prop, flag))

    def __repr__(self) -> str:
        return f"CudaDriver(ordinal={self.ordinal}, granularity={self._granularity})"

    # -- protocol ---------------------------------------------------------------------------------------------
    def granularity(self) -> int:
        self._enter("granularity")
        return self._granularity

    def reserve(self, size: int, alignment: int) -> int:
        self._enter("reserve", size=size, alignment=alignment)
        got: list[tuple] = []
        try:  # given back unless returned: Note [Every call is whole, even when interrupted]
            va = int(self._native(got, "reserve", "cuMemAddressReserve", size, alignment, 0, 0))
            with busy(), thread_mark(self._marks), self._lock: self._reservations[va] = size  # fmt: skip
            return va
        except BaseException:
            if self._succeeded(got):
                va = int(got[0][1])
                with busy(), thread_mark(self._marks), self._lock: self._reservations.pop(va, None)  # fmt: skip
                self._cu.cuMemAddressFree(va, size)
            raise

    def free(self, va: int, size: int) -> None:
        self._enter("free", va=va, size=size)
        with busy(), thread_mark(self._marks), self._lock: return self._free(va, size)  # fmt: skip

    def _free(self, va: int, size: int) -> None:
        check_free(va, size, self._reservations.get(va) == size, self._mappings)
        got: list[tuple] = []
        try:  # the records follow what CUDA did: Note [Every call is whole, even when interrupted]
            self._native(got, "free", "cuMemAddressFree", va, size)
            del self._reservations[va]
        except BaseException:
            if self._succeeded(got):
                self._reservations.pop(va, None)
            raise

    def create(self, size: int) -> int:
        self._enter("create", size=size)
        got: list[tuple] = []
        try:  # released unless returned: Note [Every call is whole, even when interrupted]
            handle = int(self._native(got, "create", "cuMemCreate", size, self._prop, 0))
            with busy(), thread_mark(self._marks), self._lock: self._live.add(handle)  # fmt: skip
            return handle
        except BaseException:
            if self._succeeded(got):
                handle = int(got[0][1])
                with busy(), thread_mark(self._marks), self._lock: self._live.discard(handle)  # fmt: skip
                self._cu.cuMemRelease(handle)
            raise

    def release(self, handle: int) -> None:
        self._enter("release")
        with busy(), thread_mark(self._marks), self._lock: return self._release(handle)  # fmt: skip

    def _release(self, handle: int) -> None:
        self._check_live("release", handle)
        got: list[tuple] = []
        try:  # Note [Every call is whole, even when interrupted]
            self._native(got, "release", "cuMemRelease", handle)
            self._live.discard(handle)
        except BaseException:
            if self._succeeded(got):
                self._live.discard(handle)
            raise

    def map(self, va: int, size: int, handle: int, offset: int = 0) -> None:
        self._enter("map", va=va, size=size, offset=offset)
        with busy(), thread_mark(self._marks), self._lock: return self._map(va, size, handle, offset)  # fmt: skip

    def _map(self, va: int, size: int, handle: int, offset: int) -> None:
        check_inside("map", va, size, self._reservations.items())
        check_no_overlap(va, size, self._mappings.items())
        self._check_live("map", handle)
        got: list[tuple] = []
        try:  # undone unless recorded: Note [Every call is whole, even when interrupted]
            self._native(got, "map", "cuMemMap", va, size, offset, handle, 0)
            self._mappings[va] = size
        except BaseException:
            if self._succeeded(got) and va not in self._mappings:
                self._cu.cuMemUnmap(va, size)
            raise

    def unmap(self, va: int, size: int) -> None:
        self._enter("unmap", va=va, size=size)
        with busy(), thread_mark(self._marks), self._lock: return self._unmap(va, size)  # fmt: skip

    def _unmap(self, va: int, size: int) -> None:
        check_one_mapping(va, size, self._mappings.get(va))
        got: list[tuple] = []
        try:  # the records follow what CUDA did: Note [Every call is whole, even when interrupted]
            self._native(got, "unmap", "cuMemUnmap", va, size)
            del self._mappings[va]
        except BaseException:
            if self._succeeded(got):
                self._mappings.pop(va, None)
            raise

    def set_access(self, va: int, size: int) -> None:
        self._enter("set_access", va=va, size=size)
        with busy(), thread_mark(self._marks), self._lock: return self._set_access(va, size)  # fmt: skip

    def _set_access(self, va: int, size: int) -> None:
        mapped_parts(va, size, self._mappings.items())  # with the native call: Note [One lock over records and ...]
        self._call("set_access", "cuMemSetAccess", va, size, self._access, len(self._access))

    def zero(self, va: int, size: int) -> None:
        self._enter("zero", va=va, size=size)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._call("zero", "cuMemsetD8Async", va, 0, size, stream)

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self._enter("tensor", va=va, size=nbytes)
        self._make_current()
        return torch.as_tensor(DeviceArray(va, nbytes, keeper), device=self.device)

    def accessible(self, va: int) -> bool:  # Note [accessible() probes unmapped addresses]
        self._enter("accessible", va=va)
        self._make_current()
        err, flags = self._cu.cuMemGetAccess(self._access[0].location, va)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            return False
        return int(flags) == int(self._cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)

    def synchronize(self) -> None:
        self._enter("synchronize")
        torch.cuda.synchronize(self.device)

    def mem_info(self) -> tuple[int, int]:
        self._enter("mem_info")
        free, total = self._call("mem_info", "cuMemGetInfo")
        return int(free), int(total)

    # -- helpers -----------------------------------------------------------------------------------------------
    def _enter(self, op: str, **values: int) -> None:
        """What every call checks first, before any lock: its process, its thread (``records.check_entry``), its
        values (``check_range``)."""
        check_entry(op, self.name, self._pid, self._marks, op in _LOCKING, values)
        check_range(op, **values)

    def _check_live(self, op: str, handle: int) -> None:
        """Refuse ``op`` on a handle that is not live here (released, or never made by this driver), before CUDA
        sees it (called with the lock held): Note [cuMemMap takes a released handle]."""
        if handle not in self._live:
            raise DriverError(
                op, f"handle {handle:#x} is not a live handle of this driver (released already, or not made by it)"
            )

    def _succeeded(self, got: list[tuple]) -> bool:
        """Whether the native call whose result ``got`` holds (stored by C, or empty) succeeded."""
        return bool(got) and got[0][0] == self._cu.CUresult.CUDA_SUCCESS

    def _make_current(self) -> None:  # Note [Current context]
        if getattr(self._local, "ready", False):
            return
        self._check("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(self._ctx))
        self._local.ready = True

    def _call(self, op: str, fn: str, *args: Any) -> Any:
        return self._native([], op, fn, *args)

    def _native(self, got: list[tuple], op: str, fn: str, *args: Any) -> Any:
        """Call ``fn(*args)`` in this driver's context, its result tuple appended to ``got`` by C (Note [A result is
        stored by C] in ``host``: the caller's ``except`` clause finds it there, whatever line an exception lands
        on), and return its value, or raise the typed error for ``op`` when it failed."""
        self._make_current()
        got.extend(starmap(getattr(self._cu, fn), [args]))
        return self._check(fn, got[0], op, args)

    def _check(self, fn: str, result: tuple, op: str | None = None, args: tuple = ()) -> Any:
        err, *values = result
        if err != self._cu.CUresult.CUDA_SUCCESS:
            shown = ", ".join(
                hex(a) if isinstance(a, int) and a > 1 << 20 else str(a)
                for a in args
                if not isinstance(a, (list, self._cu.CUmemAllocationProp))
            )
            kind = DriverOutOfMemory if err.name in _OOM_NAMES else DriverError
            raise kind(op or fn, f"{fn}({shown}) returned {err.name}", int(err))
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)
