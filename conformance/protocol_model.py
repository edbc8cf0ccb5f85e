"""The driver protocol (``extensible_kv/drivers/_protocol.py``) as an executable model: what every call returns,
refuses and changes.

The model is pure Python and shares no code with any driver. It keeps what a driver must keep: reservations,
handles, mappings, access per granule, the bytes written through tensors and ``zero`` (per handle, so every mapping
of a handle shows them), and the bytes held. For each call it returns a ``Prediction``: the refusal the protocol
demands (``Refusal``, naming the sentence), or what the call must return and how the state changes once it did
(``Prediction.apply``). ``judge`` compares a driver's outcome with a prediction, ``memory_problem`` the free bytes
around a call, ``linearize`` the calls of several threads with some serial order of them.

Each clause names the protocol sentence it implements (``implements``, collected in ``IMPLEMENTED``);
``tests/unit/test_protocol_sentences.py`` checks that every sentence id of the protocol has a clause here and a rule
that names it (``protocol_machine.py``, ``thread_machine.py``, ``protocol_checks.py``), and that this model names no id
the protocol lacks.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from extensible_kv.errors import DriverError, DriverOutOfMemory

MAX_BYTES = 1 << 63
"""Sizes, addresses and offsets are below this (P-bad-value)."""

UNREACHABLE_BYTES = 1 << 62
"""A reservation this large exceeds every address space (P-reserve-too-large)."""

IMPLEMENTED: dict[str, list[str]] = {}
"""Sentence id -> the clauses (functions of this module) that implement it."""


def implements(*ids: str) -> Callable:
    """Mark a clause as the code of the protocol sentences ``ids``."""

    def mark(fn: Callable) -> Callable:
        for sentence in ids:
            IMPLEMENTED.setdefault(sentence, []).append(fn.__qualname__)
        return fn

    return mark


class CallerError(ValueError):
    """A rule asked about a call that breaks a caller's obligation (P-units): the protocol predicts nothing for it."""


@dataclass(frozen=True)
class Refusal:
    """The call must raise ``DriverError`` naming ``op`` (``DriverOutOfMemory`` when ``oom``), by ``sentence``."""

    op: str
    sentence: str
    why: str
    oom: bool = False

    def __str__(self) -> str:
        kind = "DriverOutOfMemory" if self.oom else "DriverError"
        return f"{kind}(operation={self.op!r}): {self.why} [{self.sentence}]"


def _nothing(result: object) -> list[str]:
    return []


@dataclass
class Prediction:
    """What one call must do: be refused (``refusal``), or succeed and pass ``apply(result)``, which checks what it
    returned (a list of problems, empty when right) and changes the model. ``memory`` says how the free bytes move
    across the call: ``("takes", n)``, ``("gives", n)``, ``("same", 0)``, or ``None`` (no promise)."""

    op: str
    refusal: Refusal | None = None
    apply: Callable[[object], list[str]] = _nothing
    memory: tuple[str, int] | None = None

    def __str__(self) -> str:
        return str(self.refusal) if self.refusal else "success"


@dataclass(frozen=True)
class Reservation:
    va: int
    size: int
    alignment: int

    @property
    def end(self) -> int:
        return self.va + self.size


@dataclass(frozen=True)
class Mapping:
    va: int
    size: int
    handle: int
    offset: int

    @property
    def end(self) -> int:
        return self.va + self.size


@dataclass(frozen=True)
class Extent:
    """Handle bytes ``[lo, hi)`` hold zeros (``seed`` None) or the pattern of ``seed`` at index ``q - origin``."""

    lo: int
    hi: int
    seed: int | None
    origin: int


@dataclass
class Handle:
    key: int
    size: int
    released: bool = False
    maps: int = 0
    extents: list[Extent] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        """Its bytes are held: not yet both released and unmapped everywhere (P-release-returns)."""
        return not self.released or self.maps > 0


@dataclass(frozen=True)
class Granule:
    """What the kernel (and ``accessible``) must show at a granule: ``kind`` is ``nothing``, ``reserved``,
    ``mapped`` or ``accessible``; a mapped granule shows byte ``offset`` of handle ``handle``."""

    kind: str
    handle: int | None = None
    offset: int | None = None


@dataclass(frozen=True)
class Piece:
    """Known bytes at ``[va, va+nbytes)``: zeros (``seed`` None) or the pattern of ``seed`` from index ``index``."""

    va: int
    nbytes: int
    seed: int | None
    index: int


class ProtocolModel:
    """The state a driver must be in, and what each call must do to it.

    ``offsets``: whether the driver maps at a non-zero offset, ``parts`` whether it maps less than a whole handle
    (P-map-offset), ``partial_access`` whether it grants access to part of a mapping (P-access): the rules learn each
    with one call. ``exact``: whether ``mem_info`` is
    exact (the host: P-mem-exact); otherwise only the protocol's inequalities hold. ``free`` and ``total`` are
    ``mem_info`` when the model starts.
    """

    def __init__(
        self,
        granularity: int,
        total: int,
        free: int,
        *,
        offsets: bool,
        parts: bool,
        partial_access: bool,
        exact: bool,
        device: str,
    ) -> None:
        self.g = granularity
        self.total = total
        self.held_before = self._held_before(total, free, exact)
        self.offsets = offsets
        self.parts = parts
        self.partial_access = partial_access
        self.exact = exact
        self.device = device
        self.reservations: dict[int, Reservation] = {}
        self.handles: dict[int, Handle] = {}
        self.mappings: dict[int, Mapping] = {}
        self.access: set[int] = set()  # granule addresses granted access

    @staticmethod
    @implements("P-mem-exact")
    def _held_before(total: int, free: int, exact: bool) -> int:
        """Bytes held when the model starts: none on an exact driver (its ``total`` is its own memory, and every
        earlier rule gave its handles back, as the leak guard checks), so its first ``mem_info`` must show
        ``free == total``; elsewhere whatever the device's other users hold."""
        return 0 if exact else total - free

    # -- arguments ------------------------------------------------------------------------------------------------
    @implements("P-bad-value")
    def _bad_value(self, op: str, **values: int) -> Refusal | None:
        for name, value in values.items():
            low = 1 if name == "size" else 0
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < MAX_BYTES:
                return Refusal(op, "P-bad-value", f"{name}={value!r} is outside [{low}, 2**63)")
        if sum(values.get(k, 0) for k in ("va", "size", "offset")) >= MAX_BYTES:
            return Refusal(op, "P-bad-value", f"{values} reaches 2**63")
        return None

    @implements("P-units")
    def _units(self, op: str, **values: int) -> None:
        bad = {k: v for k, v in values.items() if v % self.g}
        if bad:
            raise CallerError(f"{op} with {bad}: not multiples of the granularity {self.g} (P-units)")

    @implements("P-units", "P-zero", "P-tensor")
    def _touchable(self, op: str, va: int, nbytes: int) -> None:
        if nbytes < 1 or any(a not in self.access for a in self._granules(va, nbytes)):
            raise CallerError(f"{op} of [{va:#x}, +{nbytes}) touches bytes without access (P-units)")

    @implements("P-release-once", "P-map-released")
    def _handle(self, op: str, key: int) -> Handle:
        """Handle ``key``, unless its memory is free again: then it is gone, and no caller passes it (its value may
        name a later handle)."""
        h = self.handles[key]
        if not h.alive:
            raise CallerError(f"{op} of handle {key}, released and unmapped everywhere: gone (P-release-once)")
        return h

    # -- queries of the model --------------------------------------------------------------------------------------
    def _granules(self, va: int, nbytes: int) -> range:
        g = self.g
        return range(va // g * g, va + nbytes, g)

    def reservation_at(self, va: int) -> Reservation | None:
        return next((r for r in self.reservations.values() if r.va <= va < r.end), None)

    def mapping_at(self, va: int) -> Mapping | None:
        return next((m for m in self.mappings.values() if m.va <= va < m.end), None)

    @implements(
        "P-accessible",
        "P-accessible-kernel",
        "P-reserve-inaccessible",
        "P-map-no-access",
        "P-unmap",
        "P-access",
        "P-map",
        "P-free",
    )
    def granule(self, va: int) -> Granule:
        """What must be at the granule holding ``va``."""
        base = va // self.g * self.g
        m = self.mapping_at(base)
        if m is not None:
            kind = "accessible" if base in self.access else "mapped"
            return Granule(kind, m.handle, m.offset + base - m.va)
        return Granule("reserved" if self.reservation_at(base) else "nothing")

    def mappings_in(self, r: Reservation) -> list[Mapping]:
        return sorted((m for m in self.mappings.values() if r.va <= m.va < r.end), key=lambda m: m.va)

    @implements("P-refusal-unchanged")
    def unmapped_runs(self, r: Reservation) -> list[tuple[int, int]]:
        """The maximal runs ``(lo, hi)`` of unmapped granules of ``r``: each must still take a new mapping after a
        refusal."""
        runs, lo = [], None
        for va in range(r.va, r.end, self.g):
            if self.mapping_at(va) is None:
                lo = va if lo is None else lo
            elif lo is not None:
                runs.append((lo, va))
                lo = None
        if lo is not None:
            runs.append((lo, r.end))
        return runs

    def accessible_runs(self) -> list[tuple[int, int]]:
        """The maximal runs ``(lo, hi)`` of accessible granules, each inside one reservation (across mappings)."""
        runs = []
        for r in sorted(self.reservations.values(), key=lambda r: r.va):
            lo = None
            for va in range(r.va, r.end, self.g):
                if va in self.access:
                    lo = va if lo is None else lo
                elif lo is not None:
                    runs.append((lo, va))
                    lo = None
            if lo is not None:
                runs.append((lo, r.end))
        return runs

    @implements("P-mem-exact", "P-create-memory", "P-release-returns")
    def held(self) -> int:
        """Bytes of every handle not yet released and unmapped everywhere."""
        return sum(h.size for h in self.handles.values() if h.alive)

    @implements("P-mem-exact")
    def expected_free(self) -> int:
        return self.total - self.held_before - self.held()

    @implements("P-release-returns", "P-create-memory")
    def alive(self) -> dict[int, int]:
        """key -> bytes of each handle whose memory is held (on the host: whose memfd the kernel holds)."""
        return {k: h.size for k, h in self.handles.items() if h.alive}

    @implements("P-release-returns")
    def unreleased(self) -> set[int]:
        """Handles not yet released (on the host: each holds one open memfd file descriptor)."""
        return {k for k, h in self.handles.items() if not h.released}

    @implements("P-map", "P-map-shared", "P-map-remap", "P-release-mapped", "P-zero", "P-tensor")
    def known_bytes(self) -> list[Piece]:
        """Every accessible byte whose value is known (written or zeroed through some mapping of its handle), at
        every address that shows it."""
        pieces = []
        for m in sorted(self.mappings.values(), key=lambda m: m.va):
            extents = self.handles[m.handle].extents
            for va in range(m.va, m.end, self.g):
                if va not in self.access:
                    continue
                lo, hi = m.offset + va - m.va, m.offset + va - m.va + self.g
                for e in extents:
                    a, b = max(lo, e.lo), min(hi, e.hi)
                    if a < b:
                        pieces.append(Piece(m.va + a - m.offset, b - a, e.seed, a - e.origin))
        return pieces

    def clone(self) -> ProtocolModel:
        """A copy whose changes leave this model as it is (reservations, mappings and extents are immutable)."""
        new = copy.copy(self)
        new.reservations, new.mappings, new.access = dict(self.reservations), dict(self.mappings), set(self.access)
        new.handles = {k: replace(h, extents=list(h.extents)) for k, h in self.handles.items()}
        return new

    def state(self) -> tuple:
        """The whole state, hashable: equal states behave alike (used by ``linearize``)."""
        handles = tuple((k, h.size, h.released, h.maps, tuple(h.extents)) for k, h in sorted(self.handles.items()))
        return (
            tuple(sorted(self.reservations.items())),
            tuple(sorted(self.mappings.items())),
            handles,
            tuple(sorted(self.access)),
        )

    # -- interrupted calls --------------------------------------------------------------------------------------
    @implements("P-interrupted")
    def interrupted(self, op: str, *args: object) -> ProtocolModel | None:
        """The state a call of ``op`` with ``args`` (a call this model takes) may have left when an exception
        interrupted it, besides this one (the call never made): a copy of this model with the call made; ``None`` for
        ``reserve`` and ``create``, whose result never reached the caller, so they must leave nothing."""
        if op in ("reserve", "create"):
            return None
        done = self.clone()
        made = getattr(done, op)(*args)
        if made.refusal is not None:
            raise CallerError(f"{op}{args} is refused here: an interrupted refusal changes nothing either way")
        made.apply(None)
        return done

    # -- the calls ---------------------------------------------------------------------------------------------
    @implements("P-granularity")
    def granularity(self) -> Prediction:
        def apply(result: object) -> list[str]:
            ok = isinstance(result, int) and result > 0 and result % 4096 == 0 and result == self.g
            why = f"granularity() returned {result!r}, expected {self.g} (a positive multiple of 4096, the same "
            return [] if ok else [why + "on every call)"]

        return Prediction("granularity", apply=apply)

    @implements("P-reserve-aligned", "P-reserve-disjoint", "P-reserve-too-large", "P-reserve-inaccessible")
    def reserve(self, size: int, alignment: int) -> Prediction:
        bad = self._bad_value("reserve", size=size, alignment=alignment)
        if bad:
            return Prediction("reserve", bad, memory=("same", 0))
        self._units("reserve", size=size, alignment=alignment)
        if alignment < self.g or alignment & (alignment - 1):  # the granularity is a power of two (4096 times one)
            raise CallerError(
                f"reserve alignment {alignment}: not the granularity {self.g} times a power of two (P-units)"
            )
        if size >= UNREACHABLE_BYTES:
            return Prediction(
                "reserve",
                Refusal("reserve", "P-reserve-too-large", f"{size} bytes exceed every address space"),
                memory=("same", 0),
            )

        def apply(va: object) -> list[str]:
            if isinstance(va, bool) or not isinstance(va, int) or not 0 <= va <= (1 << 64) - size:
                return [f"reserve returned {va!r}, not an address with room for {size} bytes"]
            problems = []
            if va % alignment:
                problems.append(
                    f"reserve returned {va:#x}, {va % alignment} bytes past a multiple of the alignment "
                    f"{alignment} [P-reserve-aligned]"
                )
            clash = [r for r in self.reservations.values() if r.va < va + size and va < r.end]
            if clash:
                problems.append(
                    f"reserve returned [{va:#x}, +{size}), overlapping the live reservation "
                    f"[{clash[0].va:#x}, +{clash[0].size}) [P-reserve-disjoint]"
                )
            self.reservations[va] = Reservation(va, size, alignment)
            return problems

        return Prediction("reserve", apply=apply)

    @implements("P-free", "P-free-refused")
    def free(self, va: int, size: int) -> Prediction:
        bad = self._bad_value("free", va=va, size=size)
        if bad:
            return Prediction("free", bad, memory=("same", 0))
        self._units("free", va=va, size=size)
        r = self.reservations.get(va)
        if r is None or r.size != size:
            return Prediction(
                "free",
                Refusal("free", "P-free-refused", f"[{va:#x}, +{size}) is not one live reservation"),
                memory=("same", 0),
            )
        inside = self.mappings_in(r)
        if inside:
            return Prediction(
                "free",
                Refusal("free", "P-free-refused", f"the reservation still has {len(inside)} live mapping(s)"),
                memory=("same", 0),
            )

        def apply(result: object) -> list[str]:
            del self.reservations[va]
            return [] if result is None else [f"free returned {result!r}, expected None"]

        return Prediction("free", apply=apply)

    @implements("P-create", "P-create-oom", "P-create-memory")
    def create(self, size: int) -> Prediction:
        """``apply`` takes the key the rules give the new handle."""
        bad = self._bad_value("create", size=size)
        if bad:
            return Prediction("create", bad, memory=("same", 0))
        self._units("create", size=size)
        if size > self.total or (self.exact and size > self.expected_free()):
            free = f"{self.expected_free()} free of " if self.exact else ""
            return Prediction(
                "create",
                Refusal("create", "P-create-oom", f"{size} bytes asked, {free}{self.total} bytes in all", oom=True),
                memory=("same", 0),
            )

        def apply(key: object) -> list[str]:
            self.handles[key] = Handle(key, size)
            return []

        return Prediction("create", apply=apply, memory=("takes", size))

    @implements("P-native-failure")
    def natively_refused(self, op: str, why: str) -> Prediction:
        """A call whose native call failed (``why``: what the machine refused it): ``DriverError`` naming ``op``,
        nothing changed (free bytes the same; the checks after the step hold everything else to the model)."""
        return Prediction(op, Refusal(op, "P-native-failure", why), memory=("same", 0))

    @implements("P-release-mapped", "P-release-returns", "P-release-once")
    def release(self, key: int) -> Prediction:
        h = self._handle("release", key)
        if h.released:
            return Prediction(
                "release",
                Refusal("release", "P-release-once", f"handle {key} was released already"),
                memory=("same", 0),
            )

        def apply(result: object) -> list[str]:
            h.released = True
            return [] if result is None else [f"release returned {result!r}, expected None"]

        return Prediction("release", apply=apply, memory=("gives", h.size) if h.maps == 0 else None)

    @implements(
        "P-map",
        "P-map-no-access",
        "P-map-offset",
        "P-map-inside",
        "P-map-overlap",
        "P-map-handle-end",
        "P-map-released",
    )
    def map(self, va: int, size: int, key: int, offset: int = 0) -> Prediction:
        bad = self._bad_value("map", va=va, size=size, offset=offset)
        if bad:
            return Prediction("map", bad, memory=("same", 0))
        self._units("map", va=va, size=size, offset=offset)
        h = self._handle("map", key)
        reason = None
        if not any(r.va <= va and va + size <= r.end for r in self.reservations.values()):
            reason = ("P-map-inside", f"[{va:#x}, +{size}) is not inside one live reservation")
        elif any(m.va < va + size and va < m.end for m in self.mappings.values()):
            reason = ("P-map-overlap", f"[{va:#x}, +{size}) overlaps a live mapping")
        elif h.released:
            reason = ("P-map-released", f"handle {key} was released")
        elif offset + size > h.size:
            reason = ("P-map-handle-end", f"offset {offset} + size {size} is past the {h.size}-byte handle")
        elif offset and not self.offsets:
            reason = ("P-map-offset", f"offset {offset}: this driver maps at offset 0 only")
        elif size != h.size and not self.parts:
            reason = ("P-map-offset", f"{size} of the {h.size}-byte handle: this driver maps whole handles only")
        if reason:
            return Prediction("map", Refusal("map", *reason), memory=("same", 0))

        def apply(result: object) -> list[str]:
            self.mappings[va] = Mapping(va, size, key, offset)
            h.maps += 1
            return [] if result is None else [f"map returned {result!r}, expected None"]

        return Prediction("map", apply=apply)

    @implements("P-unmap", "P-unmap-refused", "P-release-returns")
    def unmap(self, va: int, size: int) -> Prediction:
        bad = self._bad_value("unmap", va=va, size=size)
        if bad:
            return Prediction("unmap", bad, memory=("same", 0))
        self._units("unmap", va=va, size=size)
        m = self.mappings.get(va)
        if m is None or m.size != size:
            return Prediction(
                "unmap",
                Refusal("unmap", "P-unmap-refused", f"[{va:#x}, +{size}) is not exactly one live mapping"),
                memory=("same", 0),
            )
        h = self.handles[m.handle]

        def apply(result: object) -> list[str]:
            del self.mappings[va]
            self.access.difference_update(self._granules(va, size))
            h.maps -= 1
            return [] if result is None else [f"unmap returned {result!r}, expected None"]

        dies = h.released and h.maps == 1
        return Prediction("unmap", apply=apply, memory=("gives", h.size) if dies else None)

    @implements("P-access", "P-access-refused")
    def set_access(self, va: int, size: int) -> Prediction:
        bad = self._bad_value("set_access", va=va, size=size)
        if bad:
            return Prediction("set_access", bad, memory=("same", 0))
        self._units("set_access", va=va, size=size)
        unmapped = [a for a in self._granules(va, size) if self.mapping_at(a) is None]
        if unmapped:
            return Prediction(
                "set_access",
                Refusal(
                    "set_access",
                    "P-access-refused",
                    f"[{va:#x}, +{size}) has {len(unmapped)} unmapped granule(s), the first at {unmapped[0]:#x}",
                ),
                memory=("same", 0),
            )
        cut = [m for m in (self.mapping_at(va), self.mapping_at(va + size - 1)) if m.va < va or va + size < m.end]
        if cut and not self.partial_access:
            return Prediction(
                "set_access",
                Refusal(
                    "set_access",
                    "P-access",
                    f"[{va:#x}, +{size}) covers part of the "
                    f"mapping [{cut[0].va:#x}, +{cut[0].size}): this driver grants "
                    f"access to whole mappings only",
                ),
                memory=("same", 0),
            )

        def apply(result: object) -> list[str]:
            self.access.update(self._granules(va, size))
            return [] if result is None else [f"set_access returned {result!r}, expected None"]

        return Prediction("set_access", apply=apply)

    @implements("P-zero")
    def zero(self, va: int, size: int) -> Prediction:
        bad = self._bad_value("zero", va=va, size=size)
        if bad:
            return Prediction("zero", bad, memory=("same", 0))
        self._touchable("zero", va, size)

        def apply(result: object) -> list[str]:
            self._paint(va, size, None)
            return [] if result is None else [f"zero returned {result!r}, expected None"]

        return Prediction("zero", apply=apply)

    @implements("P-tensor", "P-tensor-device", "P-tensor-keeper")
    def tensor(self, va: int, nbytes: int) -> Prediction:
        """``apply`` takes what the tensor showed: ``data_ptr``, ``numel``, ``dtype``, ``dim``, ``device`` (as
        strings and ints) and ``keeper_alive`` (the keeper, dropped by the caller, is still alive)."""
        want = {
            "data_ptr": va,
            "numel": nbytes,
            "dtype": "torch.uint8",
            "dim": 1,
            "device": self.device,
            "keeper_alive": True,
        }

        def apply(seen: object) -> list[str]:
            return [
                f"tensor({va:#x}, {nbytes}).{k}: expected {v!r}, got {seen.get(k)!r}"  # type: ignore[union-attr]
                for k, v in want.items()
                if seen.get(k) != v
            ]  # type: ignore[union-attr]

        return Prediction("tensor", apply=apply)

    @implements("P-tensor", "P-map-shared")
    def write(self, va: int, nbytes: int, seed: int) -> Prediction:
        """A write of the pattern of ``seed`` through a tensor over ``[va, va+nbytes)`` (not a driver call)."""
        self._touchable("write", va, nbytes)

        def apply(result: object) -> list[str]:
            self._paint(va, nbytes, seed)
            return []

        return Prediction("write", apply=apply)

    @implements("P-accessible")
    def accessible(self, va: int) -> Prediction:
        want = self.granule(va).kind == "accessible"

        def apply(result: object) -> list[str]:
            return [] if result is want else [f"accessible({va:#x}) returned {result!r}, expected {want}"]

        return Prediction("accessible", apply=apply)

    @implements("P-synchronize")
    def synchronize(self) -> Prediction:
        return Prediction(
            "synchronize",
            apply=lambda result: [] if result is None else [f"synchronize returned {result!r}, expected None"],
        )

    @implements("P-mem-bounds", "P-mem-exact")
    def mem_info(self) -> Prediction:
        def apply(result: object) -> list[str]:
            if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(x, int) for x in result)):
                return [f"mem_info returned {result!r}, expected (free, total) ints"]
            free, total = result
            problems = []
            if total != self.total or not 0 <= free <= total:
                problems.append(
                    f"mem_info returned {result}: expected total {self.total} (the same for the "
                    f"driver's life) and 0 <= free <= total [P-mem-bounds]"
                )
            if self.exact and free != self.expected_free():
                problems.append(
                    f"mem_info free {free}, expected {self.expected_free()}: total {self.total} (the "
                    f"driver's own memory) less {self.held()} held by the handles alive "
                    f"{sorted(self.alive().values())}, nothing held before the rule [P-mem-exact]"
                )
            return problems

        return Prediction("mem_info", apply=apply)

    # -- judging outcomes ------------------------------------------------------------------------------------------
    @implements("P-create-memory", "P-release-returns", "P-refusal-unchanged", "P-mem-exact")
    def memory_problem(self, prediction: Prediction, before: int, after: int) -> str | None:
        """Whether the free bytes read just ``before`` and ``after`` a call moved as ``prediction`` says: exactly
        on an exact driver, else at least as far (a refused call must leave them exactly)."""
        if prediction.memory is None:
            return None
        how, n = prediction.memory
        moved = after - before
        if how == "same":
            ok, want = moved == 0, "unchanged"
        elif how == "takes":
            ok, want = (moved == -n) if self.exact else (moved <= -n), f"{n} bytes fewer"
        else:
            ok, want = (moved == n) if self.exact else (moved >= n), f"{n} bytes more"
        if ok:
            return None
        return f"mem_info free bytes across {prediction.op}: expected {want}, went from {before} to {after}"

    @implements("P-reserve-kernel", "P-free-kernel")
    def address_space_change(self, op: str, va: int, size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """``(added, removed)``: the ranges of reserved address space (anonymous, no access) the host kernel gains
        and loses across a ``reserve`` or ``free`` of ``[va, va+size)`` that succeeded, around the range (alignment
        included): exactly the range, nothing else."""
        return ([(va, va + size)], []) if op == "reserve" else ([], [(va, va + size)])

    def _paint(self, va: int, nbytes: int, seed: int | None) -> None:
        # In address order: a write goes from low to high addresses, so where two mappings inside the range alias
        # one byte of a handle (map_many may map a granule of a handle already mapped beside it), the byte written
        # last, through the higher address, is the one that stays.
        for m in sorted(self.mappings.values(), key=lambda m: m.va):
            lo, hi = max(va, m.va), min(va + nbytes, m.end)
            if lo >= hi:
                continue
            h_lo = m.offset + lo - m.va
            h = self.handles[m.handle]
            new = Extent(h_lo, h_lo + hi - lo, seed, h_lo - (lo - va))
            kept = []
            for e in h.extents:
                if e.hi <= new.lo or new.hi <= e.lo:
                    kept.append(e)
                    continue
                if e.lo < new.lo:
                    kept.append(Extent(e.lo, new.lo, e.seed, e.origin))
                if new.hi < e.hi:
                    kept.append(Extent(new.hi, e.hi, e.seed, e.origin))
            h.extents = sorted([*kept, new], key=lambda e: e.lo)


MAY_BE_MEMORY = ("P-reserve-too-large", "P-native-failure")
"""Refusals whose native cause may be a lack of memory (address space, the kernel's own memory): a
``DriverOutOfMemory`` is a right answer there; every other refusal is not for lack of memory."""


@implements("P-refusal", "P-oom", "P-native-failure")
def judge(prediction: Prediction, raised: BaseException | None) -> str | None:
    """Whether a call that raised ``raised`` (None: returned) did what ``prediction`` says: a refusal is a
    ``DriverError`` naming the operation (``DriverOutOfMemory`` for lack of memory), never another error type, and a
    call the protocol takes does not raise. Returns the problem, or None."""
    refusal = prediction.refusal
    if refusal is None:
        return None if raised is None else f"expected success, got {raised!r}"
    if raised is None:
        return f"expected {refusal}, got no error"
    want = DriverOutOfMemory if refusal.oom else DriverError
    if not isinstance(raised, want):
        return f"expected {refusal}, got {type(raised).__name__}: {raised}"
    if isinstance(raised, DriverOutOfMemory) and not refusal.oom and refusal.sentence not in MAY_BE_MEMORY:
        return f"expected {refusal}, got DriverOutOfMemory, which says memory ran short (P-oom): {raised}"
    if raised.operation != refusal.op:
        return f"expected {refusal}, got a {type(raised).__name__} naming operation {raised.operation!r}: {raised}"
    return None


@implements("P-refusal-names")
def unnamed(raised: BaseException, args: Sequence[object]) -> str | None:
    """Whether the message of a refusal ``raised`` for a call with ``args`` names none of them (an integer in decimal
    or hex, a handle as ``str`` or ``repr`` shows it): the problem, or None."""
    text = str(raised).lower()
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool):
            shown = {str(a), hex(a)}
        else:
            shown = {str(a).lower(), repr(a).lower()}
        if any(s in text for s in shown):
            return None
    return f"its message {str(raised)!r} names none of the call's arguments {list(args)} (an integer in decimal or hex)"


@dataclass(frozen=True)
class Event:
    """One call a thread made: ``op`` with the model's arguments, and what happened (``raised``, or ``result`` in
    the model's terms: a handle's key, a tensor's properties)."""

    op: str
    args: tuple
    raised: BaseException | None
    result: object = None


def replay(model: ProtocolModel, event: Event) -> str | None:
    """Apply ``event`` to ``model`` (changed in place); the problem if the protocol does not allow it here."""
    try:
        prediction = getattr(model, event.op)(*event.args)
    except CallerError as exc:
        return str(exc)
    problem = judge(prediction, event.raised)
    if problem:
        return f"{event.op}{event.args}: {problem}"
    if event.raised is None:
        problems = prediction.apply(event.result)
        if problems:
            return f"{event.op}{event.args}: {'; '.join(problems)}"
    return None


@implements("P-threads")
def linearize(model: ProtocolModel, histories: Sequence[Sequence[Event]]) -> tuple[ProtocolModel | None, str]:
    """A serial order of the threads' calls (each thread's in its own order) that the protocol allows from
    ``model``: the model after it, or None and why none exists (the furthest order tried, and what each thread's next
    call could not do there)."""
    seen: set[tuple] = set()
    best: list = [(-1, "")]

    def search(m: ProtocolModel, at: tuple[int, ...]) -> ProtocolModel | None:
        if all(i == len(h) for i, h in zip(at, histories, strict=True)):
            return m
        key = (at, m.state())
        if key in seen:
            return None
        seen.add(key)
        why = []
        for t, history in enumerate(histories):
            if at[t] == len(history):
                continue
            trial = m.clone()
            problem = replay(trial, history[at[t]])
            if problem:
                why.append(f"thread {t} call {at[t]}: {problem}")
                continue
            found = search(trial, at[:t] + (at[t] + 1,) + at[t + 1 :])
            if found is not None:
                return found
        if sum(at) > best[0][0]:
            best[0] = (sum(at), f"after calls {list(at)} of each thread: {' | '.join(why) or 'no order completes'}")
        return None

    found = search(model.clone(), (0,) * len(histories))
    return found, ("" if found is not None else best[0][1])


def intervals_minus(a: Iterable[tuple[int, int]], b: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the ranges ``a`` outside every range of ``b`` (half-open ranges, merged)."""
    cuts = _merged(sorted(b))
    ends = [hi for _, hi in cuts]  # sorted, the cuts being merged
    out = []
    for lo, hi in sorted(a):
        j = bisect.bisect_right(ends, lo)  # the first cut ending past lo
        while lo < hi and j < len(cuts) and cuts[j][0] < hi:
            if cuts[j][0] > lo:
                out.append((lo, cuts[j][0]))
            lo, j = max(lo, cuts[j][1]), j + 1
        if lo < hi:
            out.append((lo, hi))
    return _merged(out)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges with those that touch or overlap joined."""
    merged: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if merged and merged[-1][1] >= lo:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        elif lo < hi:
            merged.append((lo, hi))
    return merged
