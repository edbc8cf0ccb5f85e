"""What the model-based rules share: the calls to the raw driver, each held to the model's prediction, the comparison
of every observable with the model after every step, and the teardown that gives back everything the driver holds for
a machine (the fixture's Ledger sees none of it). The rules themselves are in ``protocol_machine.py`` (one thread)
and ``thread_machine.py`` (two threads); ``test_protocol_model.py`` runs them."""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import os
import resource
import signal
import sys
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from hypothesis.stateful import RuleBasedStateMachine, invariant

from extensible_kv.errors import DriverError

from .helpers import (
    MEMFD_NAME,
    expect,
    expect_equal,
    first_mismatch,
    host_kernel,
    kernel_memfds,
    open_memfd_sizes,
    touch,
)
from .kernel_view import AccessProbe, KernelView, maps_text, open_memfds
from .protocol_model import MAX_BYTES, Prediction, ProtocolModel, intervals_minus, judge, unnamed

FAULTS = ("SIGSEGV", "SIGBUS")
ADDRESSED = ("free", "map", "unmap", "set_access", "zero")  # the calls whose first arguments are a range
TOUCH_EVERY = 6  # steps between two faults provoked in a child (a fork costs ~15 ms; EFAULT probes run every step)


@contextlib.contextmanager
def lowered(limit: int, soft: int):
    """The soft resource limit ``limit`` (``resource.RLIMIT_*``) at ``soft`` until the block ends, the hard one
    kept: the kernel refuses the native calls that would pass it."""
    old, hard = resource.getrlimit(limit)
    resource.setrlimit(limit, (soft, hard))
    try:
        yield
    finally:
        resource.setrlimit(limit, (old, hard))


def no_new_descriptors():
    """The process may open no new file descriptor until the block ends (RLIMIT_NOFILE's soft limit set to the
    lowest free descriptor, the one the next open would take)."""
    return lowered(resource.RLIMIT_NOFILE, next(fd for fd in itertools.count() if not _is_open(fd)))


def no_files_larger_than_a_byte():
    """No file may grow past one byte until the block ends (RLIMIT_FSIZE; Python ignores the SIGXFSZ that comes
    with it, so the call fails with EFBIG)."""
    return lowered(resource.RLIMIT_FSIZE, 1)


def more_address_space(nbytes: int):
    """A factory of blocks in which the process may map at most ``nbytes`` more (RLIMIT_AS at its size then, plus
    ``nbytes``)."""

    def limited():
        with open("/proc/self/status") as status:
            size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
        return lowered(resource.RLIMIT_AS, size + nbytes)

    return limited


NATIVE_LIMITS = {
    "no new file descriptor": no_new_descriptors,
    "no file larger than a byte": no_files_larger_than_a_byte,
    "at most 1 MiB more address space": more_address_space(1 << 20),
    "at most 1 GiB more address space": more_address_space(1 << 30),
}
"""Kernel limits under which a host driver's native calls fail (the next memfd, a memfd's size, a new mapping: one
smaller than a granule, one that takes a plain reservation but no padding for a large alignment), each a context
manager factory: the calls made inside one must be refused as the protocol says for a native failure, or succeed
where the driver needs none of what the limit withholds."""


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def pattern_at(index: int, nbytes: int, seed: int) -> torch.Tensor:
    """Bytes ``index .. index+nbytes`` of the pattern of ``seed`` (``helpers.pattern``'s formula, from any index)."""
    idx = torch.arange(index, index + nbytes, dtype=torch.int64)
    return ((idx * 131 + seed * 71 + (idx >> 9) * 17) % 251 + 1).to(torch.uint8)


@dataclass(frozen=True)
class Setup:
    """What every example of a machine shares: the fixture's Ledger (naming the driver in messages; its ``inner`` is
    called), whether the kernel's records can be read (a host mmap/memfd driver), whether the driver maps at a non-zero
    offset and maps part of a handle (P-map-offset), and whether it grants access to part of a mapping (P-access),
    each learnt once."""

    driver: object
    host: bool
    offsets: bool
    parts: bool
    partial_access: bool
    failures: list[str] = field(default_factory=list)  # every check that failed, for a race's report


def learn_taken(driver, op: str, call) -> bool:
    """Whether ``call()`` (a ``op`` the protocol lets a driver take or refuse) was taken; a refusal must name ``op``."""
    try:
        call()
    except DriverError as exc:
        expect_equal(
            driver, f"{op} the driver refused, to learn whether it takes it: the refusal's operation", op, exc.operation
        )
        return False
    return True


def learn_setup(driver) -> Setup:
    """Learn once whether the driver maps less than a whole handle, and at a non-zero offset (a driver whose native
    call maps whole handles only refuses them, naming map; the host driver's mmap takes both), and whether it grants
    access to part of a mapping (one whose native call takes whole mappings only refuses it, naming set_access).
    Checks: P-map-offset, P-access."""
    raw, g = driver.inner, driver.granularity()
    va = raw.reserve(2 * g, g)
    handle = raw.create(2 * g)
    try:
        parts = learn_taken(driver, "map", lambda: raw.map(va, g, handle, 0))
        if parts:
            raw.unmap(va, g)
        offsets = learn_taken(driver, "map", lambda: raw.map(va, g, handle, g))
        if offsets:
            raw.unmap(va, g)
        raw.map(va, 2 * g, handle, 0)
        try:
            partial = learn_taken(driver, "set_access", lambda: raw.set_access(va, g))
        finally:
            raw.unmap(va, 2 * g)
    finally:
        raw.release(handle)
        raw.free(va, 2 * g)
    host = host_kernel(driver)
    expect(
        offsets and parts or not host,
        driver,
        "map of part of a handle, at offset 0 and at a non-zero offset, on a host (mmap) driver",
        "taken",
        f"taken at offset 0: {parts}, at a non-zero offset: {offsets}",
    )
    return Setup(driver, host, offsets, parts, partial)


class Keeper:
    """A keeper for ``tensor``: weakly referenceable, so the rules see how long the tensor holds it."""


def shown(args: tuple) -> str:
    return ", ".join(
        (f"{a:#x}" if abs(a) >= 1 << 20 else str(a)) if isinstance(a, int) else type(a).__name__ for a in args
    )


class ProtocolChecks(RuleBasedStateMachine):
    """The calls, the comparison of every observable with the model after every step, and the teardown that gives
    back everything the driver holds for the machine (the Ledger sees none of it)."""

    def __init__(self, setup: Setup) -> None:
        super().__init__()
        self.setup = setup
        self.driver = setup.driver
        self.raw = setup.driver.inner
        self.g = self.raw.granularity()
        self.free0, total = self.raw.mem_info()
        self.model = ProtocolModel(
            self.g,
            total,
            self.free0,
            offsets=setup.offsets,
            parts=setup.parts,
            partial_access=setup.partial_access,
            exact=setup.host,
            device=str(self.raw.device),
        )
        self.objects: dict[int, object] = {}  # handle key -> the driver's handle
        self.keys = itertools.count()
        # What the driver made and still holds, whatever the model says: the teardown gives back all of it.
        self.made_reservations: dict[int, int] = {}
        self.made_mappings: dict[int, int] = {}
        self.made_unreleased: set[int] = set()
        self.freed: list[tuple[int, int]] = []  # reservations freed, for calls on stale ranges
        self.inodes: dict[int, int] = {}  # handle key -> its memfd's inode (host)
        self.refused: list[tuple[int, int]] = []  # ranges of calls refused since the last check (P-refusal-unchanged)
        self.steps = 0
        self.probe = AccessProbe() if setup.host else None
        self.fds0 = open_memfds() if setup.host else []
        self.held0 = kernel_memfds() if setup.host else {}

    # -- calling the driver ----------------------------------------------------------------------------------------
    def _fail_unless(self, cond: bool, what: str, expected: object, actual: object) -> None:
        expect(cond, self.driver, what, expected, actual)

    def call(
        self,
        prediction: Prediction,
        *args: object,
        key: int | None = None,
        convert=None,
        within=contextlib.nullcontext,
        or_refused: Prediction | None = None,
    ) -> tuple[bool, object]:
        """Make the call ``prediction`` is about with ``args`` on the raw driver (inside ``within()``: the machine's
        limits for a call its native side may fail), and hold what it did to the prediction, or to ``or_refused``
        when it raised and that is given (a call the machine may refuse natively): the outcome (``judge``), what it
        returned (``apply``, with ``convert`` turning the driver's result into the model's terms) and how the free
        bytes moved. Returns (succeeded, result)."""
        op = prediction.op
        kernel = self._kernel_holds() if self.setup.host and (prediction.refusal or or_refused) else None
        before = self.raw.mem_info()[0]
        try:
            with within():
                result, raised = getattr(self.raw, op)(*args), None
        except Exception as exc:  # every exception is an outcome the model judges
            result, raised = None, exc
        after = self.raw.mem_info()[0]
        if kernel is not None and raised is not None:
            self._kernel_unchanged(f"{op}({shown(args)}), refused", kernel)
        if raised is not None and or_refused is not None:
            prediction = or_refused
        if raised is None:
            self.record_made(op, args, result, key)
            if convert is not None:
                result = convert(result)
        what = f"{op}({shown(args)})" + ("" if key is None else f" of handle {key}")
        outcome = repr(raised) if raised is not None else f"success, returning {result!r}"
        self._fail_unless(judge(prediction, raised) is None, what, str(prediction), outcome)
        if raised is not None:
            self._fail_unless(unnamed(raised, args) is None, what, "a refusal naming a value", unnamed(raised, args))
        if raised is None:
            problems = prediction.apply(result)
            self._fail_unless(not problems, what, "what the protocol says it returns", "; ".join(problems))
        moved = self.model.memory_problem(prediction, before, after)
        self._fail_unless(moved is None, what, "mem_info free bytes as the protocol says", moved)
        if prediction.refusal is not None:
            self.refused.append((args[0], args[1]) if op in ADDRESSED else (0, 0))
        return raised is None, result

    @staticmethod
    def _kernel_holds() -> tuple[str, dict[int, int]]:
        """What the kernel holds for a host driver in this process: its maps (memfds mapped among them) and the memfds
        it holds open (inode: bytes)."""
        return maps_text(), open_memfd_sizes()

    def _kernel_unchanged(self, what: str, before: tuple[str, dict[int, int]]) -> None:
        """A refused call left the kernel holding what it held before it: no address space reserved or given back, no
        memfd mapped, unmapped, made, grown or closed (P-refusal-unchanged, P-native-failure), wherever it is. The maps
        as text first (the same text: nothing changed); else the reserved space and memfd ranges they show."""
        after = self._kernel_holds()
        if after == before:
            return
        views = [KernelView(text) for text, _ in (before, after)]
        heaps = [h for v in views for h in v.thread_heaps()]  # malloc's, growing beside the call
        space, space2 = (intervals_minus(v.reserved_space(0, 1 << 64), heaps) for v in views)
        mapped, mapped2 = (v.memfd_ranges() for v in views)
        memfds, memfds2 = before[1], after[1]  # as read then: a view reads the descriptors open now
        got = {
            "reserved address space (gained, lost)": (intervals_minus(space2, space), intervals_minus(space, space2)),
            "memfd mappings (gained, lost)": (intervals_minus(mapped2, mapped), intervals_minus(mapped, mapped2)),
            "memfds (inode: bytes)": memfds2,
        }
        want = {
            "reserved address space (gained, lost)": ([], []),
            "memfd mappings (gained, lost)": ([], []),
            "memfds (inode: bytes)": memfds,
        }
        expect_equal(self.driver, f"{what}: what the kernel holds, vs before the call", want, got)

    def call_in_child(self, prediction: Prediction, *args: object) -> None:
        """``call`` in a forked child, for a call the protocol refuses that a driver which took it would run on
        memory it does not own (``zero`` of a size or an address no native call takes, on the host): a crash there
        is an outcome to report, not the end of the run. Refused, it changes nothing here either. A refusal in the
        child that names none of the call's values is a driver refusing every call after a fork (the host driver's
        Note [No use after fork]), which says nothing about this call: the call is made here instead (``call``),
        where a driver that took it crashes the run, a failure of this rule too."""
        op = prediction.op
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # a multi-threaded process forks: the child only calls
            pid = os.fork()
        if pid == 0:
            code = 5
            try:
                faulthandler.disable()
                getattr(self.raw, op)(*args)
                code = 0
            except DriverError as exc:
                code = 4 if exc.operation != op else 3 if unnamed(exc, args) is None else 6
            except BaseException:  # the child reports by exit status only
                code = 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 6:
            self.call(prediction, *args)
            return
        if os.WIFSIGNALED(status):
            raised = RuntimeError(f"the call killed the child with {signal.Signals(os.WTERMSIG(status)).name}")
        else:
            raised = {
                0: None,
                3: DriverError(op, "refused in a child process"),
                4: DriverError("another operation", "in a child process"),
                5: RuntimeError("an error other than DriverError"),
            }[os.WEXITSTATUS(status)]
        self._fail_unless(
            judge(prediction, raised) is None,
            f"{op}({shown(args)}) in a child process",
            str(prediction),
            "success" if raised is None else repr(raised),
        )
        self.refused.append((args[0], args[1]))

    def query(self, prediction: Prediction, result: object, what: str) -> None:
        problems = prediction.apply(result)
        self._fail_unless(not problems, what, "what the model says", "; ".join(problems))

    def record_made(self, op: str, args: tuple, result: object, key: int | None) -> None:
        """Record what a call that succeeded made or gave back (called from the threads too: dict and set updates)."""
        if op == "reserve":
            self.made_reservations[result] = args[0]
        elif op == "free":
            self.made_reservations.pop(args[0], None)
        elif op == "release":
            self.made_unreleased.discard(key)
        elif op == "map":
            self.made_mappings[args[0]] = args[1]
        elif op == "unmap":
            self.made_mappings.pop(args[0], None)

    def register(self, key: int):
        """What turns the handle a ``create`` returned into the model's ``key`` for it, keeping the handle."""

        def convert(handle: object) -> int:
            self.objects[key] = handle
            self.made_unreleased.add(key)
            return key

        return convert

    def under(self, op: str, limit: str | None) -> dict:
        """``call``'s arguments for a call of ``op`` made under ``NATIVE_LIMITS[limit]`` (none for ``None``): inside
        the limit, judged by the model's prediction, or, where it raised, as a native refusal naming ``op``."""
        if limit is None:
            return {}
        return {
            "within": NATIVE_LIMITS[limit],
            "or_refused": self.model.natively_refused(op, f"the kernel's limit: {limit}"),
        }

    def do_reserve(self, size: int, alignment: int, limit: str | None = None) -> int | None:
        prediction = self.model.reserve(size, alignment)
        before = KernelView() if self.setup.host else None
        ok, va = self.call(prediction, size, alignment, **self.under("reserve", limit))
        if ok and before is not None:
            self._address_space("reserve", va, size, alignment, before)
        return va if ok else None

    def do_free(self, va: int, size: int) -> bool:
        prediction = self.model.free(va, size)
        alignment = self.model.reservations[va].alignment if prediction.refusal is None else 0
        before = KernelView() if self.setup.host else None
        ok, _ = self.call(prediction, va, size)
        if ok:
            self.freed.append((va, size))
            if before is not None:
                self._address_space("free", va, size, alignment, before)
        return ok

    def _address_space(self, op: str, va: int, size: int, alignment: int, before: KernelView) -> None:
        """The reserved address space the kernel gained or lost around ``[va, va+size)`` and any range taken to
        align it: exactly the range (P-reserve-kernel, P-free-kernel)."""
        after = KernelView()
        lo, hi = max(va - alignment - self.g, 0), va + size + alignment + self.g
        old, new = before.reserved_space(lo, hi), after.reserved_space(lo, hi)
        heaps = before.thread_heaps() + after.thread_heaps()  # malloc's, growing beside the call
        got = (intervals_minus(intervals_minus(new, old), heaps), intervals_minus(intervals_minus(old, new), heaps))
        want = self.model.address_space_change(op, va, size)
        expect_equal(
            self.driver,
            f"{op}({va:#x}, {size}) with alignment {alignment}: (gained, lost) reserved "
            f"address space the kernel shows within [{lo:#x}, {hi:#x})",
            want,
            got,
        )
        if op == "free":
            left = [(r.lo, r.hi, r.perms, r.name) for r in after.rows if r.lo < va + size and va < r.hi]
            expect_equal(self.driver, f"what the kernel maps in [{va:#x}, +{size}) right after free", [], left)

    def do_create(self, size: int, limit: str | None = None) -> int | None:
        """``create(size)``, under ``NATIVE_LIMITS[limit]`` if one is named (the host): a driver that needs what the
        limit withholds fails natively (P-native-failure), one that needs none of it may still succeed."""
        prediction = self.model.create(size)
        key = next(self.keys)
        fds = open_memfds() if self.setup.host else None
        ok, _ = self.call(prediction, size, convert=self.register(key), **self.under("create", limit))
        if fds is not None:
            new = [i for i in open_memfds() if i not in fds]
            sizes = [
                os.stat(f"/proc/self/fd/{fd}").st_size
                for fd in os.listdir("/proc/self/fd")
                if self._fd_inode(fd) in new
            ]
            want = [size] if ok else []
            expect_equal(
                self.driver,
                f"sizes of the memfds opened by create({size}) that {'succeeded' if ok else 'was refused'}",
                want,
                sizes,
            )
            if ok and len(new) == 1:
                self.inodes[key] = new[0]
        return key if ok else None

    @staticmethod
    def _fd_inode(fd: str) -> int | None:
        try:
            return os.stat(f"/proc/self/fd/{fd}").st_ino if MEMFD_NAME in os.readlink(f"/proc/self/fd/{fd}") else None
        except OSError:
            return None

    def do_release(self, key: int) -> bool:
        return self.call(self.model.release(key), self.objects[key], key=key)[0]

    def do_map(self, va: int, size: int, key: int, offset: int = 0, limit: str | None = None) -> bool:
        prediction = self.model.map(va, size, key, offset)
        return self.call(prediction, va, size, self.objects[key], offset, key=key, **self.under("map", limit))[0]

    def do_unmap(self, va: int, size: int) -> bool:
        self.raw.synchronize()  # the protocol's order: outstanding work first
        return self.call(self.model.unmap(va, size), va, size)[0]

    def do_set_access(self, va: int, size: int, limit: str | None = None) -> bool:
        return self.call(self.model.set_access(va, size), va, size, **self.under("set_access", limit))[0]

    def do_zero(self, va: int, size: int) -> bool:
        return self.call(self.model.zero(va, size), va, size)[0]

    def do_write(self, va: int, nbytes: int, seed: int, span: tuple[int, int] | None = None) -> None:
        """A tensor over ``span`` (default ``[va, va+nbytes)``; its properties and keeper checked), the pattern of
        ``seed`` written through it at ``[va, va+nbytes)``."""
        t_va, t_n = span or (va, nbytes)
        keeper = Keeper()
        alive = weakref.ref(keeper)
        prediction = self.model.tensor(t_va, t_n)
        try:
            t, raised = self.raw.tensor(t_va, t_n, keeper), None
        except Exception as exc:  # judged below
            t, raised = None, exc
        del keeper
        self._fail_unless(raised is None, f"tensor({t_va:#x}, {t_n})", "a tensor", repr(raised))
        self.query(
            prediction,
            {
                "data_ptr": t.data_ptr(),
                "numel": t.numel(),
                "dtype": str(t.dtype),
                "dim": t.dim(),
                "device": str(t.device),
                "keeper_alive": alive() is not None,
            },
            f"tensor({t_va:#x}, {t_n}, keeper)",
        )
        # Another tensor on the same storage, not a view of ``t`` (a view keeps ``t`` itself alive): the storage
        # outlives the tensor object ``tensor`` returned, so must the keeper (P-tensor-keeper).
        view = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape)
        del t
        self._fail_unless(
            alive() is not None,
            f"tensor({t_va:#x}, {t_n}, keeper), then another tensor on its storage, then the first dropped",
            "the keeper alive while the storage is",
            "the keeper gone",
        )
        write = self.model.write(va, nbytes, seed)
        view[va - t_va : va - t_va + nbytes].copy_(pattern_at(0, nbytes, seed).to(view.device))
        self.raw.synchronize()
        write.apply(None)

    # -- resolving picks against the model -----------------------------------------------------------------------
    def _reservations(self):
        return sorted(self.model.reservations.values(), key=lambda r: r.va)

    def _mappings(self):
        return sorted(self.model.mappings.values(), key=lambda m: m.va)

    def _pick_handle(self, pick: int) -> int | None:
        """A handle not yet released nine times in ten, else one released but still mapped (a handle whose memory
        is free again is gone: P-release-once)."""
        unreleased = sorted(self.model.unreleased())
        pool = unreleased if unreleased and pick % 10 else sorted(self.model.alive())
        return pool[pick // 10 % len(pool)] if pool else None

    def _chain(self, first) -> list:
        """Mappings adjacent to each other from ``first`` on (several map calls tiling one range)."""
        chain = [first]
        while (nxt := self.model.mappings.get(chain[-1].end)) is not None:
            chain.append(nxt)
        return chain

    def _unmapped_granule(self, pick: int) -> int | None:
        runs = [run for r in self._reservations() for run in self.model.unmapped_runs(r)]
        if not runs:
            return None
        lo, hi = runs[pick % len(runs)]
        return lo + (pick // len(runs)) % ((hi - lo) // self.g) * self.g

    def _run_range(self, runs: list[tuple[int, int]], pick: int, start: int, length: int | str) -> tuple[int, int]:
        lo, hi = runs[pick % len(runs)]
        k = (pick // len(runs)) % ((hi - lo) // self.g)
        va = min(max(lo + k * self.g + start, lo), hi - 1)
        n = hi - va if length == "rest" else min(length, hi - va)
        return va, n

    # -- checking every observable -------------------------------------------------------------------------------
    @invariant()
    def every_observable_matches_the_model(self) -> None:
        """After every step: synchronize, granularity and mem_info return what the model says; accessible() at every
        granule of every reservation and just outside; on the host the kernel's maps, access and memfds; every known
        byte at every address that shows it; after a refusal, the reservations it aimed at still take new mappings
        across their whole range. Checks: P-synchronize, P-granularity, P-mem-bounds, P-mem-exact, P-accessible,
        P-accessible-kernel, P-reserve-inaccessible, P-map, P-map-no-access, P-map-shared, P-map-remap, P-unmap,
        P-access, P-zero, P-tensor, P-release-mapped, P-release-returns, P-create-memory, P-refusal-unchanged."""
        self.steps += 1
        try:
            self._check_everything()
        except AssertionError as exc:
            self.setup.failures.append(str(exc))
            raise

    def _check_everything(self) -> None:
        self.call(self.model.synchronize())
        self.call(self.model.granularity())
        self.call(self.model.mem_info())
        self._check_granules()
        if self.setup.host:
            self._check_kernel()
        self._check_bytes()
        if self.refused:
            self._check_usable()

    def _check_granules(self) -> None:
        g = self.g
        for r in self._reservations():
            for k, va in enumerate(range(r.va, r.end, g)):
                at = va + (k * 4099 + self.steps * 257) % g  # any address inside the granule
                self.query(
                    self.model.accessible(at),
                    self.raw.accessible(at),
                    f"accessible({at:#x}) in granule {k} of the reservation [{r.va:#x}, +{r.size})",
                )
            for at in (r.va - g, r.end):
                if self.model.reservation_at(at) is None:
                    self.query(
                        self.model.accessible(at),
                        self.raw.accessible(at),
                        f"accessible({at:#x}) just outside the reservation [{r.va:#x}, +{r.size})",
                    )

    def _inode(self, key: int | None, seen: int | None) -> int | None:
        """The inode of handle ``key``'s memfd; one made in a thread is learnt where the kernel first maps it."""
        if key is None:
            return None
        if key not in self.inodes and seen is not None and seen not in self.inodes.values():
            self.inodes[key] = seen
        return self.inodes.get(key)

    def _check_kernel(self) -> None:
        kernel = KernelView()
        faulting = []
        for r in self._reservations():
            for va in range(r.va, r.end, self.g):
                want = self.model.granule(va)
                kind, inode, offset = kernel.granule(va)
                expect_equal(
                    self.driver,
                    f"/proc/self/maps at granule {va:#x} of the reservation [{r.va:#x}, "
                    f"+{r.size}): (state, memfd inode, offset)",
                    (want.kind, self._inode(want.handle, inode), want.offset),
                    (kind, inode, offset),
                )
                at = va + (self.steps * 61) % self.g
                expect_equal(
                    self.driver,
                    f"reading and writing a byte at {at:#x} (granule {want.kind}) through the kernel",
                    want.kind == "accessible",
                    self.probe.touchable(at),
                )
                if want.kind != "accessible":
                    faulting.append(va)
        stray = intervals_minus(kernel.memfd_ranges(), [(r.va, r.end) for r in self._reservations()])
        expect_equal(self.driver, "memfd mappings the kernel shows outside every live reservation", [], stray)
        alive = self.model.alive()
        known = {self.inodes[k]: s for k, s in alive.items() if k in self.inodes}
        held = {i: s for i, s in kernel.memfds().items() if i not in self.held0}
        expect_equal(
            self.driver,
            "memfds the kernel holds (inode: bytes) for the handles alive",
            known,
            {i: held.get(i) for i in known},
        )
        expect_equal(
            self.driver,
            "bytes of the other memfds the kernel holds, vs the handles alive made in threads",
            sorted(s for k, s in alive.items() if k not in self.inodes),
            sorted(s for i, s in held.items() if i not in known),
        )
        fds = [i for i in open_memfds() if i not in self.fds0]
        unreleased = self.model.unreleased()
        released_inodes = {self.inodes[k] for k in self.model.handles if k not in unreleased and k in self.inodes}
        expect_equal(
            self.driver,
            "memfd file descriptors open: (count, those of released handles)",
            (len(unreleased), []),
            (len(fds), [i for i in fds if i in released_inodes]),
        )
        if faulting and self.steps % TOUCH_EVERY == 0:
            va = faulting[self.steps // TOUCH_EVERY % len(faulting)] + 100
            got = touch(va, write=self.steps % 2 == 0)
            expect(
                got in FAULTS,
                self.driver,
                f"touching {va:#x} ({self.model.granule(va).kind}) in a child process",
                "a fault (SIGSEGV or SIGBUS)",
                got,
            )

    def _check_bytes(self, lo: int = 0, hi: int = MAX_BYTES) -> None:
        self.raw.synchronize()
        for piece in self.model.known_bytes():
            if not lo <= piece.va < hi:
                continue
            got = self.raw.tensor(piece.va, piece.nbytes, None)
            if piece.seed is None and not torch.count_nonzero(got):  # zeros: no pattern to build
                continue
            got = got.cpu()
            want = (
                torch.zeros(piece.nbytes, dtype=torch.uint8)
                if piece.seed is None
                else pattern_at(piece.index, piece.nbytes, piece.seed)
            )
            if not torch.equal(got, want):
                what = "zeros" if piece.seed is None else f"the pattern of seed {piece.seed} from byte {piece.index}"
                expect(
                    False,
                    self.driver,
                    f"bytes [{piece.va:#x}, +{piece.nbytes}) read through tensor()",
                    what,
                    f"first mismatch at {first_mismatch(got, want)}",
                )

    def _check_usable(self) -> None:
        """After a refusal the reservations it aimed at (one of them, for a call on no range) are as usable as
        before, across their whole range: a new handle mapped over each run of unmapped granules (one handle over
        all runs where the driver maps parts of handles), with access and a write at both ends of every granule,
        read back; then it is unmapped and released again."""
        g, aimed = self.g, self.refused
        self.refused = []
        rs = self._reservations()
        hit = [r for r in rs if any(va < r.end and r.va < va + size for va, size in aimed)]
        for r in hit or rs[self.steps % max(len(rs), 1) :][:1]:
            runs = self.model.unmapped_runs(r)
            for group in ([runs] if self.model.parts else [[run] for run in runs]) if runs else []:
                key = self.do_create(max(hi - lo for lo, hi in group))
                if key is None:
                    continue
                mapped = [
                    (lo, hi) for lo, hi in group if self.do_map(lo, hi - lo, key) and self.do_set_access(lo, hi - lo)
                ]
                for lo, hi in mapped:
                    for i, va in enumerate(range(lo, hi, g)):
                        self.do_write(va, 64, 7 + i)
                        self.do_write(va + g - 64, 64, 8 + i)
                self._check_bytes(r.va, r.end)
                for lo, hi in mapped:
                    self.do_unmap(lo, hi - lo)
                self.do_release(key)

    # -- giving everything back -----------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Give back everything the driver holds for this example, each call tried; then, unless a step already
        failed (Hypothesis runs this in a ``finally``: that failure is the one to report), check that every call
        succeeded and that the memory and the kernel's memfds are as before the example."""
        failing = sys.exc_info()[1] is not None
        errors = []

        def attempt(name: str, fn, *args) -> None:
            try:
                fn(*args)
            except Exception as exc:  # every step is tried; all failures are reported
                errors.append(f"{name}({shown(args)}): {exc!r}")

        attempt("synchronize", self.raw.synchronize)
        for va, size in sorted(self.made_mappings.items()):
            attempt("unmap", self.raw.unmap, va, size)
        for key in sorted(self.made_unreleased):
            attempt("release", self.raw.release, self.objects[key])
        for va, size in sorted(self.made_reservations.items()):
            attempt("free", self.raw.free, va, size)
        self.made_mappings.clear()
        self.made_unreleased.clear()
        self.made_reservations.clear()
        self.objects.clear()
        if self.probe is not None:
            self.probe.close()
        if failing:
            return
        expect(not errors, self.driver, "giving back what the rules made (unmap, release, free)", "no error", errors)
        if self.setup.host:
            expect_equal(
                self.driver, "mem_info free bytes once everything was given back", self.free0, self.raw.mem_info()[0]
            )
            expect_equal(
                self.driver, "memfds the kernel holds once everything was given back", self.held0, kernel_memfds()
            )
