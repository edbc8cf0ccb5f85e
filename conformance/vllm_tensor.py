"""vLLM's own ExtensibleTensor (``vllm.utils.extensible_tensor``, vLLM 0.34 and later) under the API the tensor rules
call, so that ``--tensor vllm`` runs those rules on vLLM's class (``tensors.py`` selects it, per rule).

Two small pieces: ``VmmFacade`` is vLLM's ``VmmDriver`` interface over the driver under test (the rules' ``Ledger``),
installed as the ``get_vmm_driver`` vLLM's tensor module calls, so every call vLLM's tensor makes is recorded, checked
and fault-injected by the Ledger and lands on the driver under test (on a GPU, ``vllm``: vLLM's own driver); and
``VllmTensor``, this project's tensor API over vLLM's class.

Note [The adapter translates, vLLM decides]
    ``VllmTensor`` checks no size and rolls nothing back: every growth is vLLM's ``resize_segments_(sizes,
    zero_new)``, every view vLLM's ``segment_view``/``full_view`` (a dtype other than uint8 is ``.view(dtype)`` of
    it), release is vLLM's ``release_physical``, close is vLLM's ``free``. What it adds is what vLLM's caller
    (``ExtensibleKVCache`` in ``vllm/v1/worker/extensible_kv_cache.py``) keeps: the sizes on record while released
    (vLLM's tensor forgets them) and recommit as the same growth with ``zero_new=True``, as ``recommit()`` does
    there; and the state name (open, released, closed) the rules read. Errors are translated by type only:
    vLLM's ``ValueError``, ``TypeError`` and ``IndexError`` are ``InvalidSizeError``; its ``RuntimeError`` (the
    driver's) is ``CommitError`` naming the driver operation that failed (the facade saw it) and the sizes;
    anything else (an interrupt) comes out as it is.

Note [vLLM's tensor on the host driver]
    vLLM's class wants a ``cuda`` device and calls ``torch.accelerator`` (synchronize before release, empty_cache
    before a second create). On the host driver the adapter passes ``torch.device("cuda", 0)`` (vLLM's device check
    reads the type only), the facade reports DLPack's CPU device so vLLM's views are CPU tensors over the host
    driver's memory, and vLLM's module sees a ``torch`` whose ``accelerator.synchronize``/``empty_cache`` do nothing
    (there is no device work to wait for). On a GPU nothing is replaced but ``get_vmm_driver``. This is what lets the
    rules run vLLM's exact code on a CPU in CI; the findings are taken on the GPU.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch

from extensible_kv.errors import CommitError, CommitOutOfMemory, DriverError, DriverOutOfMemory, InvalidSizeError

_KDL_CPU, _KDL_CUDA, _KDL_ROCM = 1, 2, 10


def vllm_tensor_module() -> Any:
    import vllm.utils.extensible_tensor as module  # optional: vLLM >= 0.34

    return module


class VmmFacade:
    """vLLM's ``VmmDriver`` interface (``granularity(device)``, ``reserve(size)``, ``create(size, device, export)``,
    ``map(va, size, handle)``, ...) over a protocol driver; the protocol's ``DriverError`` is raised as vLLM's driver
    raises its errors (``RuntimeError("GPU driver error N: ...")``), and the last one is kept in ``last_error``."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.last_error: DriverError | None = None
        if driver.device.type == "cpu":
            self.dlpack_device_type = _KDL_CPU
        else:
            self.dlpack_device_type = _KDL_ROCM if torch.version.hip else _KDL_CUDA
        inner = getattr(driver, "inner", driver)
        self._native = getattr(inner, "vmm", None)  # vLLM's own driver, under the vllm driver

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except DriverError as exc:
            self.last_error = exc
            code = exc.code if isinstance(exc.code, int) else (2 if isinstance(exc, DriverOutOfMemory) else 1)
            raise RuntimeError(f"GPU driver error {code}: {exc}") from exc

    def ensure_context(self, device_index: int) -> None:
        if self._native is not None:
            self._native.ensure_context(device_index)

    def unusable_runtime_reason(self, device_index: int) -> str | None:
        return None

    def error_string(self, code: int) -> str:
        return str(self.last_error) if self.last_error is not None else f"error {code}"

    def granularity(self, device_index: int) -> int:
        return self.driver.granularity()

    def reserve(self, size: int) -> int:
        return self._call(self.driver.reserve, size, self.driver.granularity())

    def free_reserved(self, ptr: int, size: int) -> None:
        self._call(self.driver.free, ptr, size)

    def create(self, size: int, device_index: int, export_handle_types: int = 0) -> Any:
        return self._call(self.driver.create, size)

    def map(self, ptr: int, size: int, handle: Any) -> None:
        self._call(self.driver.map, ptr, size, handle, 0)

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        self._call(self.driver.set_access, ptr, size)

    def unmap(self, ptr: int, size: int) -> None:
        self._call(self.driver.unmap, ptr, size)

    def release(self, handle: Any) -> None:
        self._call(self.driver.release, handle)


class _NoAccelerator:
    """``torch.accelerator`` for vLLM's module on the host driver: Note [vLLM's tensor on the host driver]."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.accelerator, name)

    @staticmethod
    def synchronize(device_index: object = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def _host_torch() -> types.SimpleNamespace:
    class _Torch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    shim = _Torch("torch")
    shim.accelerator = _NoAccelerator()
    return shim


def install(driver: Any, saved: dict[str, Any]) -> VmmFacade:
    """Make vLLM's tensor module use ``driver`` (through a ``VmmFacade``); what it replaced goes into ``saved``
    (``restore`` puts it back)."""
    module = vllm_tensor_module()
    facade = VmmFacade(driver)
    shim = _host_torch() if facade.dlpack_device_type == _KDL_CPU else torch
    for name, value in (("get_vmm_driver", lambda: facade), ("torch", shim)):
        saved.setdefault(name, getattr(module, name))
        setattr(module, name, value)
    return facade


def restore(saved: dict[str, Any]) -> None:
    if saved:
        module = vllm_tensor_module()
        for name, value in saved.items():
            setattr(module, name, value)
        saved.clear()


class VllmTensor:
    """This project's tensor API over vLLM's ``ExtensibleTensor``: Note [The adapter translates, vLLM decides]."""

    zeroes_through_driver = False  # vLLM zeroes new bytes with torch's zero_() on a view, never with driver.zero

    def __init__(
        self,
        max_num_bytes: int,
        num_segments: int = 1,
        *,
        driver: Any,
        facade: VmmFacade,
        alignment: int = 1,
        segment_capacities: Sequence[int] | None = None,
    ) -> None:
        self.driver = driver
        self._facade = facade
        self._alignment = alignment  # vLLM has no unit of sizes: kept, never checked
        self._state = "open"
        self._on_record: list[int] | None = None  # sizes kept while released, as vLLM's KV cache keeps its blocks
        device = torch.device("cuda", driver.device.index or 0)
        try:
            self.inner = vllm_tensor_module().ExtensibleTensor(
                max_num_bytes, device=device, num_segments=num_segments, segment_capacities=segment_capacities
            )
        except (ValueError, TypeError, IndexError) as exc:
            raise InvalidSizeError(f"vLLM's ExtensibleTensor({max_num_bytes!r}, {num_segments!r}): {exc}") from exc
        except RuntimeError as exc:  # the reservation failed: the driver's own error, as this project's tensor raises
            raise (facade.last_error or self._commit_error(exc, max_num_bytes, 0)) from exc

    # -- what the rules read -----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.driver.device

    @property
    def base_address(self) -> int:
        return self.inner.base_ptr

    @property
    def max_num_bytes(self) -> int:
        return self.inner._max_num_bytes

    @property
    def num_segments(self) -> int:
        return self.inner.num_segments

    @property
    def segment_bytes(self) -> int:
        return self.inner.segment_capacity_bytes

    @property
    def bytes_per_segment(self) -> int:
        return self._on_record[0] if self._on_record is not None else self.inner.bytes_per_segment

    @property
    def granularity(self) -> int:
        return self.inner.granularity

    @property
    def state(self) -> str:
        return self._state

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    @property
    def released(self) -> bool:
        return self._state == "released"

    def stats(self) -> Any:
        from extensible_kv.tensor import TensorStats

        t = self.inner
        return TensorStats(
            reserved_bytes=t.capacity_bytes,
            committed_bytes=t.num_bytes,
            backed_bytes=t.physical_bytes,
            bytes_per_segment=self.bytes_per_segment,
            segment_bytes=self.segment_bytes,
            num_segments=self.num_segments,
            granularity=self.granularity,
            mappings=t.num_physical_chunks,
            state=self._state,
        )

    # -- what the rules call -----------------------------------------------------------------------------------
    def segment_view(self, index: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        try:
            view = self.inner.segment_view(index)
        except (ValueError, TypeError, IndexError) as exc:
            raise InvalidSizeError(f"vLLM's segment_view({index!r}): {exc}") from exc
        return view if dtype == torch.uint8 else view.view(dtype)

    def full_view(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        view = self.inner.full_view()
        return view if dtype == torch.uint8 else view.view(dtype)

    def resize_per_segment_(self, nbytes: int, zero_new: bool = True) -> VllmTensor:
        return self._resize([nbytes] * self.num_segments, zero_new)

    def resize_segments_(self, sizes: Sequence[int], zero_new: bool = True) -> VllmTensor:
        return self._resize(list(sizes), zero_new)

    def _resize(self, sizes: list[int], zero_new: bool) -> VllmTensor:
        old = self.inner.bytes_per_segment if len(set(self.inner._committed)) == 1 else None
        self._facade.last_error = None
        try:
            self.inner.resize_segments_(sizes, zero_new)
        except (ValueError, TypeError, IndexError) as exc:
            raise InvalidSizeError(f"vLLM's resize_segments_({sizes!r}): {exc}") from exc
        except RuntimeError as exc:
            raise self._commit_error(exc, sizes[0] if sizes else 0, old) from exc
        return self

    def release_physical(self) -> None:
        sizes = list(self.inner._committed)
        self.inner.release_physical()
        self._on_record = sizes
        self._state = "released"

    def recommit_physical(self) -> VllmTensor:
        sizes = self._on_record if self._on_record is not None else list(self.inner._committed)
        self._resize(sizes, True)
        self._on_record = None
        self._state = "open"
        return self

    def close(self, *, force: bool = False) -> None:
        self.inner.free()
        self._on_record = None
        self._state = "closed"

    def _commit_error(self, exc: BaseException, requested: int, committed: int | None) -> CommitError:
        failed = self._facade.last_error
        op = failed.operation if failed is not None else "unknown"
        kind = CommitOutOfMemory if isinstance(failed, DriverOutOfMemory) else CommitError
        return kind(
            f"vLLM's ExtensibleTensor failed at {op}: {exc}",
            operation=op,
            requested=requested,
            committed=-1 if committed is None else committed,
        )
