"""The driver protocol: the one seam a new VMM backend implements.

A driver speaks in bytes and integer addresses, modelled on the CUDA driver's virtual memory calls. Each checkable
promise carries a short id in brackets, written once where the promise is stated: the promises about every call here,
those of one method in its docstring (an id named elsewhere is written without brackets).
``conformance/protocol_model.py`` implements each id as a clause of an executable model of the protocol, the model-based
rules (``conformance/test_protocol_model.py``) drive a driver through random sequences of valid and invalid calls and
compare it with the model after every step, and ``tests/unit/test_protocol_sentences.py`` keeps the ids, the model and
the rules in step.

[P-units] Every size, address and offset passed to ``map``/``unmap``/``set_access``/``create`` is a multiple of
``granularity()``, every ``reserve`` alignment is the granularity times a power of two (what ``cuMemAddressReserve``
takes), and ``zero`` and writes through ``tensor`` touch accessible bytes only: callers (``ExtensibleTensor``)
guarantee it, and ``Ledger`` checks the granularity; a driver need not refuse anything else, and one that refuses
such a call changes nothing, as for every refusal. ``zero`` and ``tensor`` take any byte range.

[P-bad-value] A value that is not an ``int`` (a ``bool``, a ``float``), a size below 1, a negative address or offset,
or a value or range that reaches 2**63 is refused by
``reserve``, ``free``, ``create``, ``map``, ``unmap``, ``set_access`` and ``zero`` before any native call (a native API
would truncate it to a small size).

[P-refusal] Every refusal the protocol names raises ``DriverError`` whose ``operation`` is the method called.
[P-refusal-names] Its message names what was refused: at least one argument of the call, an address, size or offset
in decimal or in hex (``0x...``), or the handle as ``str`` or ``repr`` shows it.
[P-refusal-unchanged] A refused call leaves every observable as it was: which granules of every reservation are mapped
and accessible (on the host, what the kernel maps there), the bytes of every mapping, ``mem_info``, the memory and
address space the kernel holds, and every reservation as usable as before (each of its unmapped granules still takes
a new mapping).
[P-native-failure] A native call that fails raises ``DriverError`` naming the operation, never ``OSError`` or the
native library's own error, and changes nothing.
[P-oom] A call refused for lack of memory raises ``DriverOutOfMemory`` (a ``DriverError``).
[P-threads] Any call may be made from several threads at once on one driver: each takes effect whole, so what every
call returned, and the state the driver is left in, are those of some serial order of the calls (two threads mapping
one range: one mapping and one refusal; two threads releasing one handle: one release and one refusal). A driver that
lets go of its lock between its records and its native call breaks this: a call of another thread in between sees
records the device does not agree with (``conformance/test_contended_pairs.py`` starts the other call at every line
of the driver's Python code).
[P-interrupted] An exception raised inside a call while it runs (a ``KeyboardInterrupt`` from a signal handler, at any
line of the driver's own Python code) comes out of the call and leaves the call done whole or not at all: ``reserve``
and ``create``, whose result never reaches the caller, hold nothing afterwards; any other call leaves the state of
the call made or of the call never made, so the same call made again is taken or refused as that state says; and
every later call, from any thread, behaves as the protocol says for that state (no lock is left held).

The rules call the driver itself, not through ``Ledger``, so they reach its own refusals. Each method's docstring
also names the single-purpose rules that check it (in ``conformance/test_driver_contract.py``,
``conformance/test_driver_protocol.py`` and ``conformance/test_device_memory.py``); the model-based rules check
every id.

A driver that keeps its own records of reservations and mappings refuses misuse the native API would accept with
the checks of ``drivers/records.py`` (``check_range``, ``check_inside``, ``check_no_overlap``, ``check_one_mapping``,
``mapped_parts``, ``check_free``, ``check_alignment``), as the host, CUDA and HIP drivers do; the rules hold every
driver to the refusals whether it uses them or not.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import DriverLoadError

Handle = Any
"""A physical allocation handle; opaque to callers (an int on CUDA, a file descriptor record on the host)."""

DRIVER_METHODS = (
    "granularity",
    "reserve",
    "free",
    "create",
    "release",
    "map",
    "unmap",
    "set_access",
    "zero",
    "tensor",
    "accessible",
    "synchronize",
    "mem_info",
)
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
        raise ValueError(
            f"not methods of the driver protocol: {', '.join(map(repr, unknown))}; its methods are "
            f"{', '.join(DRIVER_METHODS)}"
        )
    return names


@runtime_checkable
class Driver(Protocol):
    """A virtual-memory driver. The module docstring states the promises of every call, each method's docstring its
    own."""

    name: str
    """Short name, used in test ids and error messages (``host``, ``cuda``, ...)."""

    device: torch.device
    """The torch device of every tensor ``tensor`` returns (P-tensor-device)."""

    max_handle_bytes: int | None
    """Largest physical handle the driver should be asked for (``None``: no limit). ROCm wants chunks."""

    def granularity(self) -> int:
        """[P-granularity] The size in bytes that every size, address and offset of ``map``/``unmap``/``set_access``/
        ``create`` is a multiple of: a positive multiple of 4096, the same on every call.

        Rules: test_granularity_is_a_positive_multiple_of_4096.
        """

    def reserve(self, size: int, alignment: int) -> int:
        """[P-reserve-aligned] Reserve ``size`` bytes of virtual addresses and return the first, a multiple of
        ``alignment`` (the granularity times a power of two: 1, 2 or 64 granules and more). [P-reserve-disjoint] The
        range overlaps no live reservation of the driver. [P-reserve-inaccessible] Nothing in it is accessible until
        mapped and granted access (on the host, touching it faults). [P-reserve-kernel] On the host the kernel holds
        exactly ``[va, va+size)`` as reserved (anonymous, no access): address space taken to align the range is given
        back before ``reserve`` returns (a GPU driver gives it back at the latest in ``free``: P-free-kernel).
        [P-reserve-too-large] A range no address space holds (2**62 bytes and more) is refused; its native failure
        surfaces as P-native-failure says.

        Rules: test_reserve_is_aligned_and_not_accessible, test_reserve_returns_a_range_aligned_to_the_alignment_asked,
        test_touching_a_granule_without_access_faults, test_the_kernel_maps_what_accessible_reports.
        """

    def free(self, va: int, size: int) -> None:
        """[P-free] Return the reservation ``[va, va+size)``, exactly as ``reserve`` made it, once nothing is mapped in
        it; its addresses are then no reservation (a ``map`` there is refused). [P-free-refused] Refused, changing
        nothing: a reservation with live mappings, a part of a reservation, a range around one, a range that is no live
        reservation (one already freed). [P-free-kernel] Afterwards nothing of the range, nor of address space taken to
        align it, is held: on the host the kernel maps nothing there, and the process's address space is as before the
        ``reserve``.

        Rules: test_free_of_anything_but_one_empty_reservation_is_refused_and_changes_nothing,
        test_free_returns_the_range_to_the_kernel.
        """

    def create(self, size: int) -> Handle:
        """[P-create] A physical handle of ``size`` bytes, contents undefined (CUDA does not promise zeroed pages):
        ``map`` takes any part of it within ``size`` bytes. [P-create-memory] It takes at least ``size`` bytes from
        ``mem_info()``'s free bytes (on the host exactly ``size``, and the kernel holds one new memfd of ``size``
        bytes). [P-create-oom] When memory is short (more than the free bytes on the host, more than ``total``
        anywhere): ``DriverOutOfMemory`` naming ``create``, and nothing is held (no handle, free bytes unchanged, on the
        host no new memfd).

        Rules: test_memory_is_returned_once_unmapped_and_released,
        test_create_past_free_memory_raises_driver_out_of_memory_and_leaks_nothing,
        test_committing_past_the_device_memory_raises_commit_out_of_memory.
        """

    def release(self, handle: Handle) -> None:
        """[P-release-mapped] Drop the creation reference of ``handle``; memory that is still mapped stays alive, with
        its bytes, until unmapped everywhere, as with ``cuMemRelease``. [P-release-returns] Once the handle is released
        and unmapped everywhere, the bytes ``create`` took are free again (``mem_info``; on the host the kernel holds no
        memfd of it, and the driver keeps no file descriptor of a released handle). [P-release-once] A handle is
        released once: releasing it again while it is still mapped somewhere is refused. Once its memory is free again
        the handle is gone, and a caller never passes it again (CUDA hands its value to a later handle).

        Rules: test_release_while_mapped_keeps_the_memory, test_memory_is_returned_once_unmapped_and_released,
        test_closing_a_tensor_returns_its_memory.
        """

    def map(self, va: int, size: int, handle: Handle, offset: int = 0) -> None:
        """[P-map] Back ``[va, va+size)`` with bytes ``[offset, offset+size)`` of ``handle`` (on the host: a shared
        mapping of the handle's memfd at that offset). [P-map-no-access] The new mapping is not accessible until
        ``set_access``, also when the handle was mapped before and unmapped, or is mapped and accessible at another
        address. [P-map-shared] Mappings share the handle's bytes: a handle mapped at two addresses shows the same bytes
        at both, and a write through one is read through the other. [P-map-remap] A handle unmapped and mapped again (at
        the same or another address) shows its bytes still. [P-map-offset] A driver whose native call maps whole handles
        only refuses every other mapping, changing nothing: ``hipMemMap`` takes offset 0 only, ``cuMemMap`` offset 0
        ("currently must be zero") and the handle's whole size only (``CUDA_ERROR_NOT_SUPPORTED`` for less, seen on the
        H200); any other driver (the host's mmap) takes every offset and size within the handle; whichever a driver
        does, it does for every call. Refused, changing nothing: [P-map-inside] a range not inside one live reservation
        (past its end, before its start, in a freed one); [P-map-overlap] a range overlapping a live mapping (from
        below, from above, inside, exactly, around it); [P-map-handle-end] ``offset + size`` past the handle's end;
        [P-map-released] a handle already released that is still mapped elsewhere (one whose memory is free again is
        gone: P-release-once).

        Rules: test_map_backs_the_range_with_the_handle_bytes_at_the_offset,
        test_a_handle_mapped_at_two_addresses_shows_the_same_bytes_through_both, test_mapping_alone_grants_no_access,
        test_map_over_mapped_granule_is_refused, test_map_outside_a_reservation_is_refused,
        test_map_outside_one_reservation_or_over_a_mapping_is_refused_and_changes_nothing,
        test_the_kernel_maps_what_accessible_reports.
        """

    def unmap(self, va: int, size: int) -> None:
        """[P-unmap] Return ``[va, va+size)``, exactly the range of one ``map`` call, to reserved: not accessible (on
        the host, touching it faults), and free for a new mapping. [P-unmap-refused] Refused, changing nothing: part of
        a mapping, a mapping and more, several whole mappings (also adjacent ones that tile the range), a range with
        nothing mapped.

        Rules: test_unmap_returns_range_to_reserved, test_unmap_of_a_subrange_is_refused,
        test_unmap_of_anything_but_one_whole_mapping_is_refused_and_changes_nothing,
        test_the_kernel_maps_what_accessible_reports.
        """

    def set_access(self, va: int, size: int) -> None:
        """[P-access] Make the fully mapped range ``[va, va+size)`` readable and writable by the device: one mapping, or
        adjacent mappings of several ``map`` calls; a mapping alone is not. Part of a mapping is granted by a driver
        whose native call takes it (the host's mprotect) and refused, changing nothing, by one whose native call takes
        whole mappings only (``cuMemSetAccess``); either way, the same for every call. [P-access-refused] Refused,
        changing nothing: a range with any granule unmapped (partly mapped from below or above, a gap between mappings,
        nothing mapped).

        Rules: test_set_access_makes_mapped_range_readable_and_writable,
        test_set_access_on_a_range_not_fully_mapped_is_refused_and_changes_nothing,
        test_touching_a_granule_without_access_faults.
        """

    def zero(self, va: int, size: int) -> None:
        """[P-zero] Set exactly the bytes ``[va, va+size)`` to zero, ordered with the device's current work (stream
        order on GPUs): any start and size (no alignment, 64 MiB and more, across several mappings); the bytes around
        the range keep their values.

        Rules: test_zero_sets_exactly_the_range, test_zero_sets_exactly_the_bytes_of_any_range,
        test_zero_of_64_mib_sets_every_byte.
        """

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        """[P-tensor] A 1-D ``torch.uint8`` tensor of ``nbytes`` elements over ``[va, va+nbytes)`` (``data_ptr() ==
        va``) without copying, at any address and size (64 MiB and more, across several mappings): a write through it is
        read through every other tensor and mapping of the same bytes. [P-tensor-device] Its device is the driver's
        ``device``. [P-tensor-keeper] Its storage holds a strong reference to ``keeper`` until the storage is freed.

        Rules: test_tensor_aliases_memory_without_copy, test_tensor_of_64_mib_aliases_memory_without_copy,
        test_tensor_keeps_its_keeper_alive.
        """

    def accessible(self, va: int) -> bool:
        """[P-accessible] Whether the granule at ``va`` (any address in it, also one outside every reservation) is
        mapped and readable/writable, from the driver's or the kernel's own state (not from a record the caller keeps).
        [P-accessible-kernel] On the host driver the kernel agrees: ``/proc/self/maps`` shows an accessible granule as a
        shared read-write mapping of one of the driver's memfds at the handle's offset, a mapped granule without access
        as a shared mapping of it without access, a reserved granule as anonymous memory without access; touching any
        granule that is not accessible faults.

        Rules: test_the_kernel_maps_what_accessible_reports, test_touching_a_granule_without_access_faults, and every
        rule that checks which granules are mapped.
        """

    def synchronize(self) -> None:
        """[P-synchronize] Wait for the device's outstanding work and return ``None``; called before memory is unmapped
        and before bytes written by the device (``zero``, a write through a tensor) are read back.

        Rules: every rule that reads bytes back after ``zero`` or a write through a tensor.
        """

    def mem_info(self) -> tuple[int, int]:
        """[P-mem-bounds] ``(free, total)`` bytes with ``0 <= free <= total``, ``total`` the same for the driver's life:
        the device's memory on a GPU (``cuMemGetInfo``), the driver's budget on the host (``drivers/host.py``, Note
        [Host memory accounting]). ``create`` takes from ``free`` (P-create-memory) and a handle released and unmapped
        everywhere, or a closed tensor, gives it back (P-release-returns). [P-mem-exact] On the host ``free`` is exactly
        ``total`` less the bytes of every handle not yet released and unmapped everywhere (also after odd sizes, and
        after a handle mapped at two addresses is unmapped from each and released).

        Rules: test_memory_is_returned_once_unmapped_and_released, test_closing_a_tensor_returns_its_memory,
        test_a_driver_built_again_starts_empty_and_serves,
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
