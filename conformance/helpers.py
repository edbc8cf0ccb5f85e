"""Assertion and sizing helpers shared by the conformance rules.

Every failure message names the driver, the operation, the expected and the actual value. ``expect_equal`` compares
the two values it prints; ``expect`` takes a condition that is not an equality (an ordering, a membership, a state)
and a message that states it; ``expect_bytes`` compares tensors byte by byte and names the first difference. Sizes
are built from the driver's granularity so the same rule exercises 4 KiB, 2 MiB or any other granule.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import os
import signal
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from extensible_kv import ExtensibleTensor
from extensible_kv.drivers import Ledger


def _fail(driver: Ledger, op: str, expected: object, actual: object, context: dict[str, object]) -> None:
    extra = "".join(f", {k}={v}" for k, v in context.items())
    raise AssertionError(f"driver {driver.name}: {op}: expected {expected}, got {actual}{extra}")


def expect_equal(driver: Ledger, op: str, expected: object, actual: object, **context: object) -> None:
    """Fail unless ``actual == expected``, with a message naming the driver, the operation and both values (and
    ``context``): what is printed is what was compared. For tensors use ``expect_bytes``."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        raise TypeError(f"expect_equal({op!r}) compares Python values; compare tensors with expect_bytes")
    if not actual == expected:
        _fail(driver, op, expected, actual, context)


def expect(cond: bool, driver: Ledger, op: str, expected: object, actual: object, **context: object) -> None:
    """Fail unless ``cond``, with a message naming the driver, the operation, what was expected (a statement of
    ``cond``: "a positive multiple of 4096", "between 2 and 8") and the actual value. For an equality use
    ``expect_equal``, which compares what it prints."""
    if not cond:
        _fail(driver, op, expected, actual, context)


def around_powers_of_two(*exponents: int) -> tuple[int, ...]:
    """Each side of each power of two ``2**e``: ``2**e - 1``, ``2**e`` and ``2**e + 1``, in order (the sizes and counts
    at which a driver's table, cache or fast path may change)."""
    return tuple(n for e in exponents for n in ((1 << e) - 1, 1 << e, (1 << e) + 1))


def pattern(nbytes: int, seed: int, device: torch.device) -> torch.Tensor:
    """Deterministic, position-dependent bytes (never all-zero), so misplaced or stale bytes show."""
    idx = torch.arange(nbytes, dtype=torch.int64)
    return ((idx * 131 + seed * 71 + (idx >> 9) * 17) % 251 + 1).to(torch.uint8).to(device)


@functools.lru_cache(maxsize=16)
def shared_pattern(nbytes: int, seed: int, device: torch.device) -> torch.Tensor:
    """``pattern(nbytes, seed, device)``, computed once: read it, never write it."""
    return pattern(nbytes, seed, device)


def first_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str:
    actual, expected = actual.cpu().reshape(-1), expected.cpu().reshape(-1)
    diff = (actual != expected).nonzero().flatten()
    if diff.numel() == 0:
        return "none"
    i = int(diff[0])
    return f"byte {i} of {actual.numel()}: {int(actual[i])} != {int(expected[i])} ({diff.numel()} bytes differ)"


def expect_bytes(driver: Ledger, op: str, actual: torch.Tensor, expected: torch.Tensor, **context: object) -> None:
    same = actual.shape == expected.shape and bool(torch.equal(actual.cpu(), expected.cpu()))
    if not same:
        expect(
            same,
            driver,
            op,
            f"{expected.numel()} bytes as written",
            f"first mismatch at {first_mismatch(actual, expected) if actual.shape == expected.shape else actual.shape}",
            **context,
        )


def odd_tensor(
    driver: Ledger, num_segments: int = 3, granules_per_segment: float = 2.5, **kwargs: object
) -> ExtensibleTensor:
    """A tensor whose segment boundaries fall inside granules (segment size a non-multiple of the granularity), of
    the class ``--tensor`` selects (``tensors.py``)."""
    from .tensors import new_tensor

    g = driver.granularity()
    seg = int(granules_per_segment * g)
    seg -= seg % 256
    return new_tensor(seg * num_segments, num_segments, driver=driver, **kwargs)


def granule_states(driver: Ledger, base: int, nbytes: int) -> list[bool]:
    """For each granule of ``[base, base+nbytes)``: is it mapped and accessible, per the driver's own state."""
    g = driver.granularity()
    return [driver.accessible(base + i * g) for i in range(-(-nbytes // g))]


def expected_granules(t: ExtensibleTensor) -> list[bool]:
    """Which granules must be backed for the tensor's committed prefixes (and only those)."""
    g = t.granularity
    n = -(-t.max_num_bytes // g)
    want = [False] * n
    if t.bytes_per_segment:
        for i in range(t.num_segments):
            lo = i * t.segment_bytes
            for k in range(lo // g, -(-(lo + t.bytes_per_segment) // g)):
                want[k] = True
    return want


def device_free(driver: Ledger) -> int | None:
    """Free device bytes per cuMemGetInfo on a CUDA driver; ``None`` elsewhere."""
    return driver.mem_info()[0] if driver.device.type == "cuda" else None


class GrowthState(NamedTuple):
    """What a failed growth step of a tensor must leave as it found it."""

    mappings: dict[int, int]  # the driver's live mappings
    granules: list[bool]  # granule_states over the tensor's reservation
    free: int | None  # device_free
    handles: int = 0  # handles held (this project's tensor holds none at rest; vLLM's keeps one per mapping)


def growth_state(driver: Ledger, t: ExtensibleTensor) -> GrowthState:
    held = driver.outstanding()
    return GrowthState(
        held.mappings, granule_states(driver, t.base_address, t.max_num_bytes), device_free(driver), held.handles
    )


def expect_rolled_back(
    driver: Ledger,
    t: ExtensibleTensor,
    where: str,
    before: GrowthState,
    size: int,
    data: list[torch.Tensor],
    retry: Callable[[ExtensibleTensor], object],
) -> None:
    """After ``where`` (a failed growth step of ``t``): ``t`` still holds ``size`` bytes per segment, the driver's
    mappings, accessible granules and free device memory are as in ``before``, no handle is held, segment ``i``
    still reads ``data[i]``; then ``retry(t)`` succeeds and backs exactly the granules of the new size."""
    expect_equal(driver, f"bytes_per_segment after a {where}", size, t.bytes_per_segment)
    held = driver.outstanding()
    expect_equal(driver, f"mappings after a {where}", before.mappings, held.mappings)
    expect_equal(driver, f"handles held after a {where}", before.handles, held.handles)
    states = granule_states(driver, t.base_address, t.max_num_bytes)
    expect_equal(driver, f"accessible granules after a {where}", before.granules, states)
    if before.free is not None:
        free = device_free(driver)
        expect_equal(driver, f"cuMemGetInfo free bytes after a {where}", before.free, free)
    for i, d in enumerate(data):
        expect_bytes(driver, f"segment {i} after a {where}", t.segment_view(i), d)
    retry(t)
    states, want = granule_states(driver, t.base_address, t.max_num_bytes), expected_granules(t)
    expect_equal(driver, f"accessible granules after retrying a {where}", want, states)


# -- the raw driver ------------------------------------------------------------------------------------------------
class RawDriver:
    """The driver under the fixture's Ledger, called directly (so the driver's own refusals are reached), keeping
    what a rule made through it so that ``close()`` returns all of it and the Ledger's leak check still holds."""

    def __init__(self, driver: Ledger) -> None:
        self.ledger = driver
        self.inner = driver.inner
        self.g = driver.granularity()
        self.reservations: dict[int, int] = {}  # va -> size
        self.handles: list[object] = []  # created and not yet released
        self.mappings: dict[int, int] = {}  # va -> size
        self.accessed: set[int] = set()  # granule addresses granted access

    def reserve(self, granules: int, alignment: int | None = None) -> int:
        va = self.inner.reserve(granules * self.g, alignment or self.g)
        self.reservations[va] = granules * self.g
        return va

    def create(self, size: int) -> object:
        handle = self.inner.create(size)
        self.handles.append(handle)
        return handle

    def release(self, handle: object) -> None:
        self.inner.release(handle)
        self.handles.remove(handle)

    def map(self, va: int, size: int, handle: object, offset: int = 0, access: bool = True) -> None:
        self.inner.map(va, size, handle, offset)
        self.mappings[va] = size
        if access:
            self.set_access(va, size)

    def set_access(self, va: int, size: int) -> None:
        self.inner.set_access(va, size)
        self.accessed.update(range(va, va + size, self.g))

    def unmap(self, va: int, size: int) -> None:
        self.inner.synchronize()
        self.inner.unmap(va, size)
        del self.mappings[va]
        self.accessed.difference_update(range(va, va + size, self.g))

    def free(self, va: int) -> None:
        self.inner.free(va, self.reservations[va])
        del self.reservations[va]

    def commit(self, va: int, size: int, seed: int | None = None) -> object:
        """Back ``[va, va+size)`` with a new handle (released at once: the mapping keeps it), grant access, and
        write ``pattern(size, seed)`` unless ``seed`` is None."""
        handle = self.create(size)
        self.map(va, size, handle)
        self.release(handle)
        if seed is not None:
            self.view(va, size).copy_(shared_pattern(size, seed, self.ledger.device))
            self.inner.synchronize()
        return handle

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        return self.inner.tensor(va, nbytes, None)

    def close(self) -> None:
        """Unmap, release and free what is left, every step tried; the first error is raised at the end."""
        errors = []
        steps = [(self.unmap, (va, size)) for va, size in sorted(self.mappings.items())]
        steps += [(self.release, (h,)) for h in list(self.handles)]
        steps += [(self.free, (va,)) for va in sorted(self.reservations)]
        for step, args in steps:
            try:
                step(*args)
            except Exception as exc:  # every step is tried; the first failure is reported
                errors.append(exc)
        self.mappings.clear()
        self.handles.clear()
        self.reservations.clear()
        if errors:
            raise AssertionError(
                f"driver {self.ledger.name}: returning what a rule made: expected every unmap, "
                f"release and free to succeed, got {errors[0]!r}"
            ) from errors[0]


def settle_device(driver: Ledger) -> None:
    """Run once, on an ordinary tensor of the device, the torch operations a rule's checks use (copy, compare, fill,
    sum), then return torch's cached blocks: Note [Lazy kernel loading takes device memory]."""
    if driver.device.type != "cuda":
        return
    scratch = torch.zeros(8192, dtype=torch.uint8, device=driver.device)
    scratch[:4096].copy_(shared_pattern(4096, 1, driver.device))
    expect_bytes(
        driver, "a warm-up copy on an ordinary device tensor", scratch[:4096], shared_pattern(4096, 1, driver.device)
    )
    scratch[:4096].fill_(5)
    int(scratch[:4096].sum())
    del scratch
    torch.cuda.synchronize(driver.device)
    torch.cuda.empty_cache()


# Note [Lazy kernel loading takes device memory]
#     CUDA loads a kernel's module on its first launch (lazy loading, the default since CUDA 11.7), and the module's
#     code and data take device memory that ``mem_info`` then reports as used: on the H200 (2026-12-03) about 94 MiB
#     appeared between a rule's first ``mem_info`` and its last, with every handle of the driver released, because
#     the rule's own checks (a fill and a sum) ran their first kernels in between. Rules that compare ``mem_info``
#     before and after call ``settle_device`` first.


def free_bytes(driver: Ledger) -> int:
    """Free memory per the driver's ``mem_info()`` (device memory on GPUs, the budget left on the host)."""
    return driver.mem_info()[0]


CPU_OOM_LIMIT = 4 << 30


def oom_step(driver: Ledger) -> int:
    """The step in which the rules that run out of memory take it: an eighth of ``mem_info()``'s total, in whole
    granules and at most ``max_handle_bytes``. A CPU driver whose total is over 4 GiB (the machine's memory, not a
    budget) is skipped: running it out would take the machine's memory; build it with a budget instead
    (``HostDriver(budget_bytes=...)``, as the registered host drivers are)."""
    import pytest

    g, total = driver.granularity(), driver.mem_info()[1]
    if driver.device.type == "cpu" and total > CPU_OOM_LIMIT:
        pytest.skip(
            f"driver {driver.name}: mem_info total is {total} bytes, over {CPU_OOM_LIMIT} on a CPU: give it "
            f"a memory budget to check running out of memory"
        )
    step = max(total // 8 // g * g, g)
    if driver.max_handle_bytes:
        step = min(step, max(driver.max_handle_bytes // g * g, g))
    return step


# -- the kernel's view of the host driver ----------------------------------------------------------------------------
MEMFD_NAME = "extensible-kv"


def host_kernel(driver: Ledger) -> bool:
    """Whether the kernel's own records say what ``driver`` did: a CPU driver built on the host driver (mmap and
    memfd), whose mappings ``/proc/self/maps`` shows and whose untouchable granules fault."""
    from extensible_kv.drivers.host import HostDriver

    return driver.device.type == "cpu" and isinstance(getattr(driver, "inner", driver), HostDriver)


def _maps() -> list[tuple[int, int, str, int, int, str]]:
    """``/proc/self/maps`` as (lo, hi, permissions, file offset, inode, name)."""
    rows = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            rows.append(
                (lo, hi, fields[1], int(fields[2], 16), int(fields[4]), fields[5].strip() if len(fields) == 6 else "")
            )
    return rows


def kernel_granules(base: int, nbytes: int, granularity: int) -> list[str]:
    """What the kernel maps at each granule of ``[base, base+nbytes)``: ``accessible`` (one of the host driver's
    memfds, shared and read-write), ``mapped`` (a memfd, shared, no access), ``reserved`` (anonymous, no access),
    ``nothing``, or the permissions and name the kernel shows for anything else (a private copy, anonymous rw)."""
    rows = _maps()
    states = []
    for va in range(base, base + nbytes, granularity):
        row = next((r for r in rows if r[0] <= va < r[1]), None)
        if row is None:
            states.append("nothing")
            continue
        perms, name = row[2], row[5]
        if MEMFD_NAME in name and perms in ("rw-s", "---s"):
            states.append("accessible" if perms == "rw-s" else "mapped")
        elif not name and row[4] == 0 and perms == "---p":
            states.append("reserved")
        else:
            states.append(f"{perms} {name or 'anonymous'}")
    return states


def kernel_backing(va: int) -> tuple[int, int] | None:
    """(memfd inode, byte offset in it) of what the kernel maps at ``va``, or None when it is no memfd of ours."""
    for lo, hi, _, offset, inode, name in _maps():
        if lo <= va < hi:
            return (inode, offset + va - lo) if MEMFD_NAME in name else None
    return None


def open_memfd_stats() -> list[os.stat_result]:
    """The ``stat`` of every file descriptor this process holds on one of the host driver's memfds, one per fd."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if MEMFD_NAME in os.readlink(f"/proc/self/fd/{fd}"):
                found.append(os.stat(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (the fd listing itself, another thread's file)
            pass
    return found


def open_memfd_sizes() -> dict[int, int]:
    """inode -> bytes of every memfd of the host driver this process holds a file descriptor of."""
    return {st.st_ino: st.st_size for st in open_memfd_stats()}


def kernel_memfds() -> dict[int, int]:
    """inode -> size of each memfd of the host driver that this process holds open (``/proc/self/fd``) or mapped
    (``/proc/self/maps``): the physical memory the kernel keeps for it, whatever the driver's records say."""
    found = open_memfd_sizes()
    for lo, hi, _, offset, inode, name in _maps():
        if MEMFD_NAME in name and inode not in found:
            try:
                found[inode] = os.stat(f"/proc/self/map_files/{lo:x}-{hi:x}").st_size
            except OSError:  # map_files unreadable here: the mapped extent is a lower bound
                found[inode] = max(found.get(inode, 0), offset + hi - lo)
    return found


def touch(va: int, write: bool = False) -> str:
    """Read the byte at ``va`` (and write it back when ``write``) in a forked child: ``ok``, or the name of the
    signal that killed the child (``SIGSEGV``, ``SIGBUS``) when the kernel has nothing accessible there."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a multi-threaded process: the child only reads
        pid = os.fork()
    if pid == 0:
        try:
            faulthandler.disable()
            byte = ctypes.c_uint8.from_address(va)
            if write:
                byte.value = byte.value
            else:
                _ = byte.value
        except BaseException:  # the child reports by exit status only
            os._exit(3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return "ok" if os.WEXITSTATUS(status) == 0 else f"exit {os.WEXITSTATUS(status)}"


def wait_until_gone(threads, limit_s: float = 5.0) -> None:
    """Wait (at most ``limit_s``) until the kernel has no task left of the joined ``threads``. ``join`` returns before
    a thread's C library is done with its exit, and that exit may still unmap thread stacks it kept: a check of the
    address space the driver reserved must not see that happen beside the driver's call."""
    deadline = time.monotonic() + limit_s
    for t in threads:
        tid = getattr(t, "native_id", None)
        while tid is not None and os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
            time.sleep(0.001)
