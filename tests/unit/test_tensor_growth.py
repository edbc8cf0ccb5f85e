"""Growth steps of ``ExtensibleTensor`` on the host driver, checked against the kernel: the smallest growth, a
driver that caps its handles at one granule, a driver whose ``map`` takes the offset without a default, and the
``CommitError`` of a failed step (its type, its whole message, a rollback that itself fails)."""

from __future__ import annotations

import pytest

from conformance.helpers import kernel_backing, kernel_granules, kernel_memfds
from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import CommitError, CommitOutOfMemory, DriverError, DriverOutOfMemory
from extensible_kv.tensor import ExtensibleTensor

G = 4096
NAME = "unit-host-4k"


def test_a_growth_to_one_byte_per_segment_backs_one_granule_in_each_segment():
    tensor = ExtensibleTensor(4 * G, num_segments=2, driver=HostDriver(granularity=G, name=NAME))
    try:
        tensor.resize_per_segment_(1)
        got = (tensor.bytes_per_segment, kernel_granules(tensor.base_address, 4 * G, G))
        expected = (1, ["accessible", "reserved", "accessible", "reserved"])
        assert got == expected, (
            f"HostDriver {NAME} resize_per_segment_(1) of 2 segments of 2 granules: expected "
            f"(bytes per segment, kernel granules) {expected}, got {got}"
        )
        views = [tensor.segment_view(i).tolist() for i in range(2)]
        assert views == [[0], [0]], (
            f"HostDriver {NAME} segment views after resize_per_segment_(1): expected one zeroed byte each, got {views}"
        )
    finally:
        tensor.close()


class _OneGranuleHandles(HostDriver):
    """A host driver whose physical handles are at most one granule (``max_handle_bytes``); it refuses larger ones,
    as a device with a handle size limit does."""

    max_handle_bytes = G

    def create(self, size: int):
        if size > self.max_handle_bytes:
            raise DriverError("create", f"{size} bytes asked, handles are at most {self.max_handle_bytes}")
        return super().create(size)


def test_a_driver_capping_handles_at_one_granule_gets_one_handle_per_granule():
    tensor = ExtensibleTensor(3 * G, driver=_OneGranuleHandles(granularity=G, name="unit-one-granule-handles"))
    try:
        tensor.resize_per_segment_(3 * G)
        backing = [kernel_backing(tensor.base_address + i * G) for i in range(3)]
        assert (
            None not in backing
            and len({inode for inode, _ in backing}) == 3
            and [offset for _, offset in backing] == [0, 0, 0]
        ), (
            f"HostDriver with max_handle_bytes={G}, resize_per_segment_({3 * G}): expected each granule backed by "
            f"its own memfd at offset 0, got (inode, offset) {backing}"
        )
    finally:
        tensor.close()


class _MapOffsetRequired(HostDriver):
    """A host driver whose ``map`` has the contract's signature ``map(va, size, handle, offset)`` with no default."""

    def map(self, va: int, size: int, handle: object, offset: int) -> None:
        super().map(va, size, handle, offset)


def test_growth_passes_the_map_offset_so_a_driver_without_a_default_offset_grows():
    tensor = ExtensibleTensor(2 * G, driver=_MapOffsetRequired(granularity=G, name="unit-offset-required"))
    try:
        tensor.resize_per_segment_(2 * G)
        got = (kernel_granules(tensor.base_address, 2 * G, G), int(tensor.segment_view(0).count_nonzero()))
        assert got == (["accessible", "accessible"], 0), (
            f"HostDriver with map(va, size, handle, offset), resize_per_segment_({2 * G}): expected (kernel "
            f"granules, nonzero bytes) (['accessible', 'accessible'], 0), got {got}"
        )
    finally:
        tensor.close()


def _two_segment_tensor() -> tuple[ExtensibleTensor, Ledger]:
    """2 segments of 2 granules: a growth to one granule per segment maps two runs, granules 0 and 2."""
    ledger = Ledger(HostDriver(granularity=G, name=NAME))
    return ExtensibleTensor(4 * G, num_segments=2, driver=ledger), ledger


# the failing operation, the error it raises, the CommitError type expected
FAILURES = {
    "map refused": ("map", DriverError("map", "the device refused the mapping", 1), CommitError),
    "create out of memory": ("create", DriverOutOfMemory("create", "no memory left", 2), CommitOutOfMemory),
}


@pytest.mark.parametrize("op,error,kind", FAILURES.values(), ids=FAILURES.keys())
def test_a_failed_growth_raises_commit_error_of_the_drivers_kind_naming_operation_and_sizes(op, error, kind):
    tensor, ledger = _two_segment_tensor()
    try:
        ledger.fail(op, error=error)
        with pytest.raises(CommitError) as info:
            tensor.resize_per_segment_(G)
        e = info.value
        expected = (
            f"growing {NAME} ExtensibleTensor from 0 to {G} bytes per segment (2 segment(s), {2 * G} bytes "
            f"in all) failed at {op}: {error}; kept 0 bytes per segment"
        )
        got = (type(e), str(e), e.operation, e.requested, e.committed, e.__cause__)
        assert got == (kind, expected, op, G, 0, error), (
            f"HostDriver {NAME} growth with {op} failing ({type(error).__name__}): expected {(kind, expected)}, "
            f"got {got[:2]}, operation/requested/committed/cause {got[2:]}"
        )
        granules = kernel_granules(tensor.base_address, 4 * G, G)
        assert granules == ["reserved"] * 4, (
            f"HostDriver {NAME} after the failed growth: expected the kernel to map 4 reserved granules, got {granules}"
        )
    finally:
        tensor.close()


def test_a_rollback_that_fails_twice_names_both_failures_and_close_returns_the_rest():
    tensor, ledger = _two_segment_tensor()
    base = tensor.base_address
    before = kernel_memfds()
    map_error = DriverError("map", "the device refused the second mapping")
    unmap_error = DriverError("unmap", "the device refused the unmap")
    release_error = DriverError("release", "the device refused the release")
    ledger.fail("map", 2, map_error)  # granule 2's map fails, with its handle created and not yet released
    ledger.fail("unmap", 1, unmap_error)  # the rollback cannot unmap granule 0
    ledger.fail("release", 2, release_error)  # nor release granule 2's handle (granule 0's was released)
    with pytest.raises(CommitError) as info:
        tensor.resize_per_segment_(G)
    expected = (
        f"growing {NAME} ExtensibleTensor from 0 to {G} bytes per segment (2 segment(s), {2 * G} bytes in "
        f"all) failed at map: {map_error}; the tensor is failed: close() returns the rest; rollback also failed: "
        f"unmap({base:#x}, {G}): {unmap_error}; release: {release_error}"
    )
    assert str(info.value) == expected, (
        f"HostDriver {NAME} growth failing at map with the rollback's unmap and release failing: expected "
        f"{expected!r}, got {str(info.value)!r}"
    )
    assert (info.value.committed, tensor.state) == (0, "failed"), (
        f"HostDriver {NAME} growth whose rollback could not unmap: expected committed=0 and the tensor failed, got "
        f"committed={info.value.committed}, state {tensor.state!r}"
    )
    tensor.close()  # retries what the rollback could not undo
    got = (ledger.outstanding(), kernel_granules(base, 4 * G, G), kernel_memfds())
    assert not got[0] and got[1] == ["nothing"] * 4 and got[2] == before, (
        f"HostDriver {NAME} close() after the failed rollback: expected nothing outstanding, nothing mapped and the "
        f"kernel's memfds back to {before}, got {got}"
    )
