"""The driver protocol: the one seam a new VMM backend implements.

A driver speaks in bytes and integer addresses, modelled on the CUDA driver's virtual memory calls. Every size,
address and offset passed to ``map``/``unmap``/``set_access``/``create`` is a multiple of ``granularity()``; callers
(``ExtensibleTensor``) guarantee it, and ``Ledger`` checks it. ``zero`` and ``tensor`` take any byte range.

A failed native call, and every refusal below, raises ``DriverError`` (``DriverOutOfMemory`` for lack of memory)
naming the operation, and leaves the driver's state as it was before the call: what is mapped and accessible (and,
on the host, what the kernel maps), the bytes of every mapping, the reservations (still usable), ``mem_info`` and
the memory the kernel holds. The rules call the driver itself, not through ``Ledger``, so they reach its own
refusals.

The contract, rule by rule (each method's docstring names the conformance rules that check it; the rules live in
``conformance/test_driver_contract.py``, ``conformance/test_driver_protocol.py`` and
``conformance/test_device_memory.py``):

- ``reserve(size, alignment)`` returns a virtual range of ``size`` bytes aligned to ``alignment`` (any multiple of
  the granularity) that is not accessible until mapped. ``free(va, size)`` returns exactly that range, and only
  once nothing is mapped in it: anything but one whole reservation with no live mapping is refused.
- ``create(size)`` returns a physical handle of ``size`` bytes; its contents are undefined (CUDA does not promise
  zeroed pages). When memory is short it raises ``DriverOutOfMemory`` and holds nothing. ``release(handle)`` drops
  the creation reference; memory that is still mapped stays alive until unmapped, as with ``cuMemRelease``.
- ``map(va, size, handle, offset)`` backs ``[va, va+size)`` with ``[offset, offset+size)`` of the handle, without
  access. Mappings share the handle's bytes: a handle mapped at two addresses shows the same bytes at both, and one
  unmapped and mapped again shows its bytes. A driver whose native call takes offset 0 only (``hipMemMap``;
  ``cuMemMap`` documents "currently must be zero") refuses any other offset. The range must lie in one
  reservation and must not overlap a live mapping (from below, from above, inside, exactly or around it), and
  ``[offset, offset+size)`` must lie in the handle; anything else is refused. ``unmap(va, size)`` takes exactly a
  range that one ``map`` call made (no sub-range, nothing more) and returns it to reserved.
- ``set_access(va, size)`` makes a fully mapped range readable and writable by the device; a mapping alone is not.
  A range with any granule unmapped is refused.
- ``zero(va, size)`` sets exactly the bytes of any range to zero (start and size need not be aligned, the size
  need not be small), ordered with the device's current work (stream order on GPUs).
- ``tensor(va, nbytes, keeper)`` returns a 1-D ``torch.uint8`` tensor over ``[va, va+nbytes)`` without copying, at
  any address and size; the tensor's storage must hold a strong reference to ``keeper`` until the storage is freed.
- ``accessible(va)`` reports, from the driver's or the kernel's own state (not from a record the caller keeps),
  whether the granule at ``va`` is mapped and readable/writable. On the host driver the kernel agrees: an
  accessible granule is a shared read-write mapping of one of the driver's memfds, and touching any other faults.
- ``synchronize()`` waits for the device's outstanding work; it is called before memory is unmapped.
- ``mem_info()`` returns ``(free, total)`` bytes. ``create`` takes at least ``size`` from ``free``; once a handle is
  released and unmapped everywhere its bytes are free again, and on the host the kernel no longer holds its memfd.
  On the host, ``total`` is the driver's budget (see ``drivers/host.py``, Note [Host memory accounting]).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import DriverLoadError

Handle = Any
"""A physical allocation handle; opaque to callers (an int on CUDA, a file descriptor record on the host)."""

DRIVER_METHODS = ("granularity", "reserve", "free", "create", "release", "map", "unmap", "set_access", "zero",
                  "tensor", "accessible", "synchronize", "mem_info")
"""The protocol's methods, in the order ``Driver`` below defines them: the one list of them (a unit test holds the
class to it). The registry's check of a driver, the Ledger's recorded operations, the rules' fault sweeps and the
benchmarks' call counts are derived from it; a list of some of them is written with ``protocol_methods``."""

DRIVER_ATTRIBUTES = ("name", "device", "max_handle_bytes")
"""The protocol's attributes, in the order ``Driver`` below declares them."""


def protocol_methods(*names: str) -> tuple[str, ...]:
    """``names``, each checked to be one of ``DRIVER_METHODS``: a list of some of the protocol's methods fails where
    it is written (on import) once a method is renamed or removed, instead of silently naming nothing."""
    unknown = [name for name in names if name not in DRIVER_METHODS]
    if unknown:
        raise ValueError(f"not methods of the driver protocol: {', '.join(map(repr, unknown))}; its methods are "
                         f"{', '.join(DRIVER_METHODS)}")
    return names


@runtime_checkable
class Driver(Protocol):
    """A virtual-memory driver. See the module docstring for the contract of each operation."""

    name: str
    """Short name, used in test ids and error messages (``host``, ``cuda``, ...)."""

    device: torch.device
    """The torch device whose tensors ``tensor`` returns."""

    max_handle_bytes: int | None
    """Largest physical handle the driver should be asked for (``None``: no limit). ROCm wants chunks."""

    def granularity(self) -> int:
        """The size in bytes that every size, address and offset of ``map``/``unmap``/``set_access``/``create`` is a
        multiple of: a positive multiple of 4096.

        Rules: test_granularity_is_a_positive_multiple_of_4096.
        """

    def reserve(self, size: int, alignment: int) -> int:
        """Reserve ``size`` bytes of virtual addresses aligned to ``alignment`` (any multiple of the granularity, also
        larger ones); nothing in the range is accessible (on the host, touching it faults) until mapped and granted
        access.

        Rules: test_reserve_is_aligned_and_not_accessible, test_reserve_returns_a_range_aligned_to_the_alignment_asked,
        test_touching_a_granule_without_access_faults, test_the_kernel_maps_what_accessible_reports.
        """

    def free(self, va: int, size: int) -> None:
        """Return the reservation ``[va, va+size)``, exactly as ``reserve`` made it, once nothing is mapped in it (on
        the host, the kernel then maps nothing there). Refused, changing nothing: a reservation with live mappings, a
        part of a reservation.

        Rules: test_free_of_anything_but_one_empty_reservation_is_refused_and_changes_nothing,
        test_free_returns_the_range_to_the_kernel.
        """

    def create(self, size: int) -> Handle:
        """A physical handle of ``size`` bytes, contents undefined; it takes at least ``size`` bytes from
        ``mem_info()``'s free bytes. When memory is short: ``DriverOutOfMemory``, and nothing is held (no handle, free
        bytes unchanged, on the host no new memfd).

        Rules: test_memory_is_returned_once_unmapped_and_released,
        test_create_past_free_memory_raises_driver_out_of_memory_and_leaks_nothing,
        test_committing_past_the_device_memory_raises_commit_out_of_memory.
        """

    def release(self, handle: Handle) -> None:
        """Drop the creation reference of ``handle``. Mapped memory stays alive, with its bytes, until unmapped; once
        the handle is released and unmapped everywhere its bytes are free again (``mem_info``, and on the host the
        kernel holds no memfd of it).

        Rules: test_release_while_mapped_keeps_the_memory, test_memory_is_returned_once_unmapped_and_released,
        test_closing_a_tensor_returns_its_memory.
        """

    def map(self, va: int, size: int, handle: Handle, offset: int = 0) -> None:
        """Back ``[va, va+size)`` with bytes ``[offset, offset+size)`` of ``handle``, without access. The mapping shares
        the handle's bytes: mapped at two addresses, both show the same bytes (a write through one is read through
        the other); unmapped and mapped again, it shows them still. A driver whose native call takes offset 0 only
        refuses any other offset, changing nothing. Refused, changing nothing: a range not inside one reservation
        (past its end, before its start), a range overlapping a live mapping (from below, from above, inside,
        exactly, around it), ``offset + size`` past the handle's end.

        Rules: test_map_backs_the_range_with_the_handle_bytes_at_the_offset,
        test_a_handle_mapped_at_two_addresses_shows_the_same_bytes_through_both, test_mapping_alone_grants_no_access,
        test_map_over_mapped_granule_is_refused, test_map_outside_a_reservation_is_refused,
        test_map_outside_one_reservation_or_over_a_mapping_is_refused_and_changes_nothing,
        test_the_kernel_maps_what_accessible_reports.
        """

    def unmap(self, va: int, size: int) -> None:
        """Return ``[va, va+size)``, exactly the range of one ``map`` call, to reserved: not accessible (on the host,
        touching it faults). Refused, changing nothing: part of a mapping, a mapping and more, several mappings, a
        range with nothing mapped.

        Rules: test_unmap_returns_range_to_reserved, test_unmap_of_a_subrange_is_refused,
        test_unmap_of_anything_but_one_whole_mapping_is_refused_and_changes_nothing,
        test_the_kernel_maps_what_accessible_reports.
        """

    def set_access(self, va: int, size: int) -> None:
        """Make the fully mapped range ``[va, va+size)`` readable and writable by the device. Refused, changing nothing:
        a range with any granule unmapped (partly mapped from below or above, a gap between mappings, nothing mapped).

        Rules: test_set_access_makes_mapped_range_readable_and_writable,
        test_set_access_on_a_range_not_fully_mapped_is_refused_and_changes_nothing,
        test_touching_a_granule_without_access_faults.
        """

    def zero(self, va: int, size: int) -> None:
        """Set exactly the bytes ``[va, va+size)`` to zero, in stream order on GPUs: any start and size (no alignment,
        64 MiB and more); the bytes around the range keep their values.

        Rules: test_zero_sets_exactly_the_range, test_zero_sets_exactly_the_bytes_of_any_range,
        test_zero_of_64_mib_sets_every_byte.
        """

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        """A 1-D ``torch.uint8`` tensor over ``[va, va+nbytes)`` (``data_ptr() == va``) without copying, at any address
        and size (64 MiB and more); its storage holds ``keeper`` alive until the storage is freed.

        Rules: test_tensor_aliases_memory_without_copy, test_tensor_of_64_mib_aliases_memory_without_copy,
        test_tensor_keeps_its_keeper_alive.
        """

    def accessible(self, va: int) -> bool:
        """Whether the granule at ``va`` is mapped and readable/writable, from the driver's or the kernel's own state.
        On the host driver the kernel agrees: ``/proc/self/maps`` shows an accessible granule as a shared read-write
        mapping of one of the driver's memfds (at the handle's offset), and touching any other granule faults.

        Rules: test_the_kernel_maps_what_accessible_reports, test_touching_a_granule_without_access_faults, and every
        rule that checks which granules are mapped.
        """

    def synchronize(self) -> None:
        """Wait for the device's outstanding work; called before memory is unmapped and before bytes written by the
        device (``zero``, a write through a tensor) are read back.

        Rules: every rule that reads bytes back after ``zero`` or a write through a tensor.
        """

    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of device memory (on the host: of the driver's budget). ``create`` takes at least
        its size from ``free``; a handle released and unmapped everywhere, and a closed tensor, give it back
        exactly.

        Rules: test_memory_is_returned_once_unmapped_and_released, test_closing_a_tensor_returns_its_memory,
        test_create_past_free_memory_raises_driver_out_of_memory_and_leaks_nothing,
        test_committing_past_the_device_memory_raises_commit_out_of_memory.
        """


def conforming(what: str, driver: object) -> Driver:
    """``driver`` if it has every protocol method (callable) and attribute, else ``DriverLoadError`` naming what it
    lacks; ``what`` says where the object came from (the registry's specs, ``driver=`` arguments, ``Ledger``)."""
    missing = [m for m in DRIVER_METHODS if not callable(getattr(driver, m, None))]
    missing += [a for a in DRIVER_ATTRIBUTES if not hasattr(driver, a)]
    if missing:
        raise DriverLoadError(f"{what}, which lacks the protocol's {', '.join(missing)}")
    return driver  # type: ignore[return-value]
