"""The ``vllm`` driver: vLLM's own VMM driver (``vllm.utils.vmm_driver``, vLLM 0.34 and later) under the protocol, so
that ``extensible-kv check-driver vllm`` judges the calls vLLM's extensible KV cache makes.

==========================  =========================================================================
protocol operation          what runs
==========================  =========================================================================
``granularity``             vLLM's ``VmmDriver.granularity(ordinal)`` (cuMemGetAllocationGranularity, MINIMUM)
``reserve`` / ``free``      vLLM's ``reserve(size)`` / ``free_reserved(va, size)``; an alignment past the
                            granularity through vLLM's own binding of ``cuMemAddressReserve`` (Note [Alignment])
``create`` / ``release``    vLLM's ``create(size, ordinal)`` / ``release(handle)``
``map`` / ``unmap``         vLLM's ``map(va, size, handle)`` / ``unmap(va, size)``
``set_access``              vLLM's ``set_access(va, size, ordinal)``
``zero``                    added: ``torch.Tensor.zero_`` over the range, on torch's current stream
``tensor``                  added: ``torch.as_tensor`` of a ``DeviceArray`` (holds the keeper)
``accessible``              added: ``cuMemGetAccess`` / ``hipMemGetAccess`` from the library vLLM loaded
``synchronize``             added: ``torch.cuda.synchronize``
``mem_info``                added: ``torch.cuda.mem_get_info``
==========================  =========================================================================

Note [Judge vLLM's calls, refuse nothing of our own]
    The adapter keeps no records of reservations, handles or mappings and checks no argument: every call goes to
    vLLM's driver as it is, and whatever vLLM (or the GPU driver below it) refuses comes back as the protocol's typed
    error (``_translated``). vLLM's ``RuntimeError("GPU driver error N: ...")`` becomes ``DriverError`` naming the
    operation and the arguments, with ``DriverOutOfMemory`` for code 2 (``CUDA_ERROR_OUT_OF_MEMORY``,
    ``hipErrorOutOfMemory``); a ``ctypes.ArgumentError``, ``TypeError`` or ``OverflowError`` from vLLM's ctypes
    signatures is a refusal of vLLM's as well. The refusals vLLM's driver leaves to its one caller (a range over a
    gap, a second mapping over a live one, a bool for a size) are therefore refused or not as CUDA does; the rules
    that hold a driver to them are reported "not held" under the caller-guaranteed profile this driver names
    (``conformance_profile``; ``extensible_kv_conformance.profiles``), rule by rule, never skipped silently.

Note [The adapter calls vLLM's driver as vLLM's tensor does]
    vLLM's driver does not make a context current; its caller (``_VirtualBuffer``) calls ``ensure_context`` before it
    creates and maps. The adapter does the same before every call, so a call from a thread new to the driver is
    judged on what it asks, not on a context vLLM's caller always provides. The only argument vLLM's API cannot
    express is a mapping offset: ``map`` takes none (it passes 0, which is also all ``cuMemMap`` takes), so ``map``
    at another offset is a ``DriverError`` naming it, as the CUDA driver refuses it (P-map-offset).

Note [Alignment]
    vLLM's ``reserve(size)`` passes alignment 0 (the granularity) because its tensor asks for no more; the protocol's
    ``reserve`` takes any granularity times a power of two. Past the granularity the adapter calls the
    ``address_reserve`` entry vLLM bound (``cuMemAddressReserve``/``hipMemAddressReserve``, vLLM's argtypes, vLLM's
    error check) with the alignment, so the native call is the one vLLM makes, with one argument more.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from typing import Any

import torch

from ..errors import DriverError, DriverOutOfMemory, DriverUnavailable
from ._device_array import DeviceArray

MIN_VERSION = (0, 34)
"""The first vLLM release that ships ``vllm.utils.vmm_driver``."""
OOM_CODES = (2,)
"""Native codes of running out of memory: ``CUDA_ERROR_OUT_OF_MEMORY`` and ``hipErrorOutOfMemory`` are both 2."""
PROFILE = "caller-guaranteed"
"""The conformance profile this driver names: Note [Judge vLLM's calls, refuse nothing of our own]."""
_CODE = re.compile(r"GPU driver error (-?\d+)")


def _release(text: str) -> tuple[int, ...]:
    """``0.34.0rc1`` -> ``(0, 34, 0)``: the leading numbers of a version."""
    parts = []
    for piece in text.split(".")[:3]:
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def _vllm_module() -> Any:
    import vllm.utils.vmm_driver as module  # optional dependency

    return module


def probe(ordinal: int = 0) -> str | None:
    """Why vLLM's driver cannot run here (vLLM not importable, older than 0.34, no GPU), or ``None``."""
    try:
        import vllm  # optional dependency
    except ImportError as exc:
        return f"vLLM is not importable ({exc}); the vllm driver needs vLLM >= 0.34"
    version = getattr(vllm, "__version__", "unknown")
    if _release(str(version)) < MIN_VERSION:
        return f"vLLM {version} has no VMM driver of its own (vllm.utils.vmm_driver ships from 0.34)"
    try:
        _vllm_module()
    except ImportError as exc:
        return f"vLLM {version}: vllm.utils.vmm_driver does not import ({exc})"
    if not torch.cuda.is_available() or torch.cuda.device_count() <= ordinal:
        return f"no GPU device {ordinal} that torch can use (vLLM's driver runs on CUDA and ROCm only)"
    return None


class VllmVmmDriver:
    """vLLM's ``VmmDriver`` under the protocol (see the module docstring)."""

    max_handle_bytes: int | None = None
    conformance_profile = PROFILE

    def __init__(self, ordinal: int = 0, *, vmm: Any = None, name: str = "vllm") -> None:
        if vmm is None:
            reason = probe(ordinal)
            if reason:
                raise DriverUnavailable(reason)
            torch.zeros(1, device=f"cuda:{ordinal}")  # vLLM's driver does not call cuInit: torch makes the context
            vmm = _vllm_module().get_vmm_driver()
        self.name = name
        self.ordinal = ordinal
        self.device = torch.device("cuda", ordinal)
        self.vmm = vmm
        self.native_objects = (vmm,)  # whose code the interrupt rule interrupts too
        self._get_access = _access_function(vmm)
        self._granularity = int(self._call("granularity", vmm.granularity, ordinal))

    def __repr__(self) -> str:
        return f"VllmVmmDriver(ordinal={self.ordinal}, vmm={type(self.vmm).__name__}, granularity={self._granularity})"

    # -- protocol: vLLM's own calls -----------------------------------------------------------------------------
    def granularity(self) -> int:
        return self._granularity

    def reserve(self, size: int, alignment: int) -> int:
        va = None
        try:  # given back unless returned
            if isinstance(alignment, int) and alignment > self._granularity:
                va = self._call("reserve", self._reserve_aligned, size, alignment)
            else:
                va = self._call("reserve", self.vmm.reserve, size)
            return va
        except BaseException:
            if va is not None:
                self.vmm.free_reserved(va, size)
            raise

    def free(self, va: int, size: int) -> None:
        self._call("free", self.vmm.free_reserved, va, size)

    def create(self, size: int) -> int:
        handle = None
        try:  # released unless returned
            handle = self._call("create", self.vmm.create, size, self.ordinal)
            return handle
        except BaseException:
            if handle is not None:
                self.vmm.release(handle)
            raise

    def release(self, handle: int) -> None:
        self._call("release", self.vmm.release, handle)

    def map(self, va: int, size: int, handle: int, offset: int = 0) -> None:
        if offset != 0:  # Note [The adapter calls vLLM's driver as vLLM's tensor does]
            raise DriverError(
                "map", f"vLLM's VmmDriver.map({va:#x}, {size}, {handle:#x}) takes no offset; asked offset {offset}"
            )
        self._call("map", self.vmm.map, va, size, handle)

    def unmap(self, va: int, size: int) -> None:
        self._call("unmap", self.vmm.unmap, va, size)

    def set_access(self, va: int, size: int) -> None:
        self._call("set_access", self.vmm.set_access, va, size, self.ordinal)

    # -- protocol: what vLLM's driver lacks, from torch and the library vLLM loaded ----------------------------
    def zero(self, va: int, size: int) -> None:
        try:
            view = torch.as_tensor(DeviceArray(va, size, None), device=self.device)
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            raise DriverError("zero", f"zero({va}, {size}): {exc}") from exc
        view.zero_()

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        return torch.as_tensor(DeviceArray(va, nbytes, keeper), device=self.device)

    def accessible(self, va: int) -> bool:
        self.vmm.ensure_context(self.ordinal)
        return self._get_access(va, self.ordinal)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def mem_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    # -- helpers -----------------------------------------------------------------------------------------------
    def _reserve_aligned(self, size: int, alignment: int) -> int:  # Note [Alignment]
        dptr = ctypes.c_ulonglong()
        self.vmm._check(self.vmm._fns["address_reserve"](ctypes.byref(dptr), size, alignment, 0, 0))
        return dptr.value

    def _call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` of vLLM's driver in the device's context, its errors as the protocol's (Note [Judge vLLM's
        calls, refuse nothing of our own])."""
        try:
            self.vmm.ensure_context(self.ordinal)
            return fn(*args)
        except (RuntimeError, ctypes.ArgumentError, TypeError, OverflowError, ValueError) as exc:
            raise _translated(op, getattr(fn, "__name__", op), args, exc) from exc


def _shown(args: tuple) -> str:
    big = [isinstance(a, int) and not isinstance(a, bool) and a > 1 << 20 for a in args]
    return ", ".join(hex(a) if b else repr(a) for a, b in zip(args, big))


def _translated(op: str, method: str, args: tuple, exc: BaseException) -> DriverError:
    """The protocol's typed error for ``exc``, raised by vLLM's ``method(*args)`` in operation ``op``."""
    if isinstance(exc, DriverError):
        return exc
    found = _CODE.search(str(exc))
    code = int(found.group(1)) if found else None
    kind = DriverOutOfMemory if code in OOM_CODES else DriverError
    return kind(op, f"vLLM's VmmDriver.{method}({_shown(args)}) raised {type(exc).__name__}: {exc}", code)


def _access_function(vmm: Any) -> Callable[[int, int], bool]:
    """``accessible(va, ordinal)`` through ``cuMemGetAccess`` (``hipMemGetAccess`` on ROCm) of the library vLLM's driver
    loaded, opened again so that vLLM's function objects keep their own signatures. A driver without a library (a
    fake) may offer ``accessible(va, ordinal)`` itself."""
    own = getattr(vmm, "accessible", None)
    if callable(own):
        return own
    lib = ctypes.CDLL(vmm._lib._name)
    symbol = "hipMemGetAccess" if "hip" in type(vmm).__name__.lower() else "cuMemGetAccess"
    fn = getattr(lib, symbol)
    fn.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_void_p, ctypes.c_ulonglong]
    fn.restype = ctypes.c_int
    location_cls = _vllm_module()._MemLocation
    read_write = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE, hipMemAccessFlagsProtReadWrite

    def accessible(va: int, ordinal: int) -> bool:
        location = location_cls(1, ordinal)  # device location
        flags = ctypes.c_ulonglong()
        if fn(ctypes.byref(flags), ctypes.byref(location), va) != 0:
            return False  # nothing mapped there: Note [accessible() probes unmapped addresses] in cuda
        return flags.value == read_write

    return accessible
