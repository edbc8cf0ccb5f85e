"""The driver protocol: the one seam a new VMM backend implements.

A driver speaks in bytes and integer addresses, modelled on the CUDA driver's virtual memory calls. Every size,
address and offset passed to ``map``/``unmap``/``set_access``/``create`` is a multiple of ``granularity()``; callers
(``ExtensibleTensor``) guarantee it, and ``Ledger`` checks it. A failed native call raises ``DriverError`` (or
``DriverOutOfMemory``) naming the operation and its arguments, and leaves the driver's state as it was before the
call.

The contract, rule by rule (the conformance suite checks each):

- ``reserve(size, alignment)`` returns a virtual range of ``size`` bytes aligned to ``alignment`` that is not
  accessible until mapped; ``free(va, size)`` returns exactly that range, and only once nothing is mapped in it.
- ``create(size)`` returns a physical handle of ``size`` bytes; its contents are undefined (CUDA does not promise
  zeroed pages). ``release(handle)`` drops the creation reference; memory that is still mapped stays alive until
  unmapped, as with ``cuMemRelease``.
- ``map(va, size, handle, offset)`` backs ``[va, va+size)`` with ``[offset, offset+size)`` of the handle. The range
  must lie in a reservation and must not overlap a live mapping: mapping a granule twice is an error.
  ``unmap(va, size)`` takes exactly a range that one ``map`` call made (no sub-ranges) and returns it to reserved.
- ``set_access(va, size)`` makes a fully mapped range readable and writable by the device; a mapping alone is not.
- ``zero(va, size)`` sets the bytes to zero, ordered with the device's current work (stream order on GPUs).
- ``tensor(va, nbytes, keeper)`` returns a 1-D ``torch.uint8`` tensor over ``[va, va+nbytes)`` without copying;
  the tensor's storage must hold a strong reference to ``keeper`` until the storage is freed.
- ``accessible(va)`` reports, from the driver's or the kernel's own state (not from a record the caller keeps),
  whether the granule at ``va`` is mapped and readable/writable.
- ``synchronize()`` waits for the device's outstanding work; it is called before memory is unmapped.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

Handle = Any
"""A physical allocation handle; opaque to callers (an int on CUDA, a file descriptor record on the host)."""


@runtime_checkable
class Driver(Protocol):
    """A virtual-memory driver. See the module docstring for the contract of each operation."""

    name: str
    """Short name, used in test ids and error messages (``host``, ``cuda``, ...)."""

    device: torch.device
    """The torch device whose tensors ``tensor`` returns."""

    max_handle_bytes: int | None
    """Largest physical handle the driver should be asked for (``None``: no limit). ROCm wants chunks."""

    def granularity(self) -> int: ...

    def reserve(self, size: int, alignment: int) -> int: ...

    def free(self, va: int, size: int) -> None: ...

    def create(self, size: int) -> Handle: ...

    def release(self, handle: Handle) -> None: ...

    def map(self, va: int, size: int, handle: Handle, offset: int = 0) -> None: ...

    def unmap(self, va: int, size: int) -> None: ...

    def set_access(self, va: int, size: int) -> None: ...

    def zero(self, va: int, size: int) -> None: ...

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor: ...

    def accessible(self, va: int) -> bool: ...

    def synchronize(self) -> None: ...

    def mem_info(self) -> tuple[int, int]: ...
