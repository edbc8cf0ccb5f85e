"""The model-based rules of one thread: random sequences of every protocol call, valid and invalid, on the raw driver,
each compared with the executable model (``protocol_model.py``) after every step (``protocol_checks.py``).

``ProtocolMachine`` makes many reservations (odd granule counts, alignments up to 1024 granules), many handles and
dozens of live mappings (offsets where the driver takes them, remaps, a handle at two addresses), and calls every
method inside, across and outside them: overlaps from below, above, inside, exactly and around, sub-range and tiled
unmaps, access over several mappings and gaps, frees of parts and of reservations with mappings, released handles,
offsets past the handle, values no native API takes. Each rule's docstring names the protocol sentences it checks."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from .protocol_checks import ProtocolChecks, shown
from .protocol_model import MAX_BYTES, UNREACHABLE_BYTES, CallerError

MAX_RESERVATIONS = 5
MAX_RESERVED_GRANULES = 40  # accessible() is called at every granule after every step: this bounds a step's cost
MAX_ALIVE_HANDLES = 14
MANY_MAPPINGS = 24  # one-granule mappings at once, in one example in four
PICK = st.integers(0, 255)

BAD_ARGUMENTS = ("va", "size", "offset")  # reserve's alignment stands where the offset is
BAD_KINDS = ("low", "negative", "2**63", "false", "true", "float")
BAD_VALUES = (
    *(f"{arg}_{kind}" for arg in BAD_ARGUMENTS for kind in BAD_KINDS),
    "range_to_2**63",
    "offset_to_2**63",
    "range_past_2**63",
)
"""The kinds of value ``bad_value`` passes (P-bad-value): every value of a call (address, size, offset or alignment)
just below its bound (a size of 0, an address or offset of -1), negative, at 2**63, a ``bool`` (``False`` and
``True``, which Python takes for 0 and 1) and a ``float``; and ranges reaching or passing 2**63."""
BAD_VALUE_CALLS = ("reserve", "free", "create", "map", "unmap", "set_access", "zero")

# Where writes and zeros start relative to a granule boundary inside an accessible run, and how long they are:
# small and unaligned, and across granule and mapping boundaries.
STARTS = (0, 1, 255, -1, -100, 4095, -4097)
LENGTHS = (1, 3, 256, 4097, 8195, 12301)


class ProtocolMachine(ProtocolChecks):
    """Random sequences of every protocol call from one thread (see the module docstring)."""

    def _room(self) -> bool:
        rs = self.model.reservations.values()
        return len(rs) < MAX_RESERVATIONS and sum(r.size for r in rs) < MAX_RESERVED_GRANULES * self.g

    @initialize(
        sizes=st.lists(st.integers(1, 13), min_size=2, max_size=3),
        alignment=st.sampled_from((1, 2, 64, 1024)),
        pick=PICK,
    )
    def populate(self, sizes, alignment, pick):
        """Start with two or three reservations (and one time in four another of MANY_MAPPINGS granules): the first
        (and that one) backed granule by granule (many mappings; where the driver takes offsets each of another
        granule of one handle, released half the time), with access over all of them; the second backed in part by
        one handle with access. Checks: P-reserve-aligned, P-map, P-map-offset, P-access, P-release-mapped."""
        g = self.g
        sizes = [*sizes, *([MANY_MAPPINGS] if pick % 4 == 0 else [])]
        vas = [self.do_reserve(n * g, (alignment if i == 0 else 1) * g) for i, n in enumerate(sizes)]
        for i in {0, len(sizes) - 1 if pick % 4 == 0 else 0}:
            if vas[i] is not None:
                key = self.do_create(sizes[i] * g)
                self.fill(self.model.reservations[vas[i]], key, True)
                if key is not None and pick % 2:
                    self.do_release(key)  # its mappings keep it alive: it may not be mapped again
        if vas[1] is not None:
            n = -(-sizes[1] // 2)
            key = self.do_create(n * g)
            if key is not None and self.do_map(vas[1] + (pick % 2) * (sizes[1] - n) * g, n * g, key):
                self.do_set_access(vas[1] + (pick % 2) * (sizes[1] - n) * g, n * g)

    @precondition(lambda self: self._room())
    @rule(granules=st.integers(1, 9), alignment=st.sampled_from((1, 1, 2, 4, 64, 1024)))
    def reserve(self, granules, alignment):
        """An odd or even number of granules at an alignment of 1, 2, 4, 64 or 1024 granules. Checks: P-reserve-aligned,
        P-reserve-disjoint, P-reserve-inaccessible, P-reserve-kernel, P-units."""
        self.do_reserve(granules * self.g, alignment * self.g)

    @rule(size=st.sampled_from((UNREACHABLE_BYTES, UNREACHABLE_BYTES + (1 << 61))))
    def reserve_more_than_any_address_space(self, size):
        """A range no address space holds fails natively: a DriverError naming reserve, nothing changed. Checks:
        P-reserve-too-large, P-native-failure, P-refusal, P-refusal-unchanged."""
        self.do_reserve(size, self.g)

    @rule(shape=st.sampled_from(("whole", "whole", "lower", "upper", "around", "more", "freed")), pick=PICK)
    def free(self, shape, pick):
        """A whole reservation (refused while it has mappings), a part, a range around or past it, one freed already
        (and a free that succeeded, again). Checks: P-free, P-free-refused, P-free-kernel, P-refusal."""
        g = self.g
        if shape == "freed":
            if self.freed:
                self.do_free(*self.freed[pick % len(self.freed)])
            return
        rs = self._reservations()
        if not rs:
            return
        r = rs[pick % len(rs)]
        va, size = {
            "whole": (r.va, r.size),
            "lower": (r.va, r.size - g),
            "upper": (r.va + g, r.size - g),
            "around": (r.va - g, r.size + 2 * g),
            "more": (r.va, r.size + g),
        }[shape]
        if size > 0 and self.do_free(va, size):
            self.do_free(va, size)  # again, no reservation now: refused

    @rule(pick=PICK)
    def clear_and_free(self, pick):
        """Unmap every mapping of a reservation, then free it. Checks: P-unmap, P-free, P-free-kernel,
        P-release-returns."""
        rs = self._reservations()
        if rs:
            r = rs[pick % len(rs)]
            for m in self.model.mappings_in(r):
                self.do_unmap(m.va, m.size)
            self.do_free(r.va, r.size)

    @precondition(lambda self: len(self.model.alive()) < MAX_ALIVE_HANDLES)
    @rule(granules=st.integers(1, 4))
    def create(self, granules):
        """A handle of 1 to 4 granules. Checks: P-create, P-create-memory."""
        self.do_create(granules * self.g)

    @precondition(lambda self: self.setup.host and len(self.model.alive()) < MAX_ALIVE_HANDLES)
    @rule(granules=st.integers(1, 3))
    def create_without_file_descriptors(self, granules):
        """On the host, a handle asked for while the process may open no new file descriptor: the driver's native
        call fails (memfd_create: EMFILE) and the failure is a DriverError naming create, nothing held; a driver that
        needs no new descriptor may succeed. Checks: P-native-failure, P-refusal-unchanged."""
        size = granules * self.g
        if self.model.exact and size > self.model.expected_free():
            return
        self.do_create(size, limit="no new file descriptor")

    @rule(kind=st.sampled_from(("past_total", "past_free")))
    def create_more_than_memory(self, kind):
        """More than the device's memory (more than the free bytes, where mem_info is exact): DriverOutOfMemory
        naming create, nothing held. Checks: P-create-oom, P-oom, P-refusal, P-refusal-unchanged."""
        if kind == "past_free" and self.model.exact:
            size = self.model.expected_free() // self.g * self.g + self.g
        else:
            size = self.model.total // self.g * self.g + self.g
        self.do_create(size)

    @rule(pick=PICK)
    def release(self, pick):
        """Release a handle (mapped or not), or one released already and still mapped; then, while it is mapped
        still, the one just released again, and a map of it. Checks: P-release-mapped, P-release-returns,
        P-release-once, P-map-released."""
        key = self._pick_handle(pick)
        if key is not None and self.do_release(key) and self.model.handles[key].alive:  # mapped: not gone yet
            self.do_release(key)  # again: refused
            va = self._free_run_for(self.model.handles[key].size, pick)
            if va is not None:
                self.do_map(va, self.model.handles[key].size, key)  # released, mapped elsewhere still: refused

    @rule(
        shape=st.sampled_from(
            ("free", "free", "free", "below", "above", "inside", "exact", "around", "past_end", "before_start", "freed")
        ),
        pick=PICK,
        n=st.integers(1, 4),
        handle=PICK,
        offset=st.sampled_from(("zero", "zero", "any", "past_end")),
    )
    def map(self, shape, pick, n, handle, offset):
        """Map part of a handle into an unmapped run, over a mapping (from below, above, inside, exactly, around),
        past a reservation's end or before its start, into a freed reservation; at offset 0, any offset, or past
        the handle's end; a map that succeeded, again (exactly over itself). Checks: P-map, P-map-no-access,
        P-map-offset, P-map-inside, P-map-overlap, P-map-handle-end, P-map-released."""
        key = self._pick_handle(handle)
        target = self._map_range(shape, pick, n)
        if key is None or target is None:
            return
        va, size = target
        h_size = self.model.handles[key].size
        off = {
            "zero": 0,
            "any": (pick % max(h_size // self.g, 1)) * self.g,
            "past_end": max(h_size - size + self.g, 0),
        }[offset]
        if shape == "free" and offset != "past_end":  # fits the handle (all of it, where only whole ones map)
            size = max(min(size, h_size - off), self.g) if self.model.parts else h_size
        if self.do_map(va, size, key, off):
            self.do_map(va, size, key, off)  # again, exactly over the new mapping: refused

    def _map_range(self, shape: str, pick: int, n: int) -> tuple[int, int] | None:
        g = self.g
        if shape == "freed":
            return (self.freed[pick % len(self.freed)][0], n * g) if self.freed else None
        rs = self._reservations()
        if not rs:
            return None
        r = rs[pick % len(rs)]
        if shape == "free":
            runs = self.model.unmapped_runs(r)
            if not runs:
                return None
            lo, hi = runs[pick // len(rs) % len(runs)]
            va = lo + (pick // len(rs) // len(runs)) % ((hi - lo) // g) * g
            return va, min(n * g, hi - va)
        if shape == "past_end":
            k = min(n, r.size // g)
            return r.end - k * g, (k + 1) * g
        if shape == "before_start":
            return r.va - g, n * g
        ms = self.model.mappings_in(r)
        if not ms:
            return None
        m = ms[pick // len(rs) % len(ms)]
        k = min(n, m.size // g)
        j = min(1 + pick % 3, (m.va - r.va) // g) or 1  # granules before the mapping: the refusal comes late
        return {
            "below": (m.va - j * g, (j + k) * g),
            "above": (m.end - k * g, (k + 1) * g),
            "inside": (m.va + (pick % (m.size // g)) * g, g),
            "exact": (m.va, m.size),
            "around": (m.va - j * g, m.size + (j + 1) * g),
        }[shape]

    @rule(pick=PICK)
    def map_refused_at_its_last_granule(self, pick):
        """Map a fresh handle over a whole run of unmapped granules and one more (a live mapping, or past the
        reservation's end): refused at its last granule only, after every other granule was one the driver could
        map; the run must be as usable afterwards. Checks: P-map-overlap, P-map-inside, P-refusal-unchanged."""
        runs = [(r, lo, hi) for r in self._reservations() for lo, hi in self.model.unmapped_runs(r)]
        if not runs:
            return
        r, lo, hi = runs[pick % len(runs)]
        key = self.do_create(hi - lo + self.g)
        if key is not None:
            self.do_map(lo, hi - lo + self.g, key)
            self.do_release(key)

    @rule(pick=PICK, handle=PICK, access=st.booleans())
    def map_many(self, pick, handle, access):
        """Back every unmapped granule of a reservation with a mapping of its own (one handle at successive
        offsets where the driver takes offsets, else a fresh handle each): dozens of live mappings; then access
        over the whole reservation, a range across many mappings. Checks: P-map, P-map-offset, P-access,
        P-release-mapped."""
        rs = self._reservations()
        if rs:
            self.fill(rs[pick % len(rs)], self._pick_handle(handle), access)

    def fill(self, r, key: int | None, access: bool) -> None:
        """Map every unmapped granule of ``r`` on its own: successive granules of handle ``key`` where the driver
        takes offsets and the handle has them, else a fresh one-granule handle each (released once mapped)."""
        spare = [va for lo, hi in self.model.unmapped_runs(r) for va in range(lo, hi, self.g)]
        for i, va in enumerate(spare):
            use = (
                key
                if (
                    self.model.offsets
                    and self.model.parts
                    and key is not None
                    and not self.model.handles[key].released
                    and (i + 1) * self.g <= self.model.handles[key].size
                )
                else None
            )
            if use is None:
                made = self.do_create(self.g)
                if made is None:
                    return
                self.do_map(va, self.g, made)
                self.do_release(made)
            else:
                self.do_map(va, self.g, use, i * self.g)
        if access:
            self.do_set_access(r.va, r.size)

    @rule(pick=PICK, where=PICK, access=st.booleans())
    def alias(self, pick, where, access):
        """Map a handle that is mapped already at a second address (refused if it was released). Checks:
        P-map-shared, P-map-no-access, P-map-released."""
        ms = self._mappings()
        if not ms:
            return
        m = ms[pick % len(ms)]
        va = self._free_run_for(m.size, where)
        if va is not None and self.do_map(va, m.size, m.handle, m.offset) and access:
            self.do_set_access(va, m.size)

    def _free_run_for(self, size: int, pick: int) -> int | None:
        starts = [
            lo + k
            for r in self._reservations()
            for lo, hi in self.model.unmapped_runs(r)
            for k in range(0, hi - lo - size + 1, self.g)
        ]
        return starts[pick % len(starts)] if starts else None

    @rule(pick=PICK, where=st.sampled_from(("same", "elsewhere")), access=st.booleans())
    def remap(self, pick, where, access):
        """Unmap a mapping and map its handle again, at the same or another address: no access until granted, the
        bytes still there (refused if the handle was released and is mapped elsewhere still; gone, and not mapped
        again, if that was its last mapping). Checks: P-map-remap, P-map-no-access, P-unmap, P-map-released."""
        ms = self._mappings()
        if not ms:
            return
        m = ms[pick % len(ms)]
        if not self.do_unmap(m.va, m.size) or not self.model.handles[m.handle].alive:  # gone with its last mapping
            return
        va = m.va if where == "same" else self._free_run_for(m.size, pick)
        if va is not None and self.do_map(va, m.size, m.handle, m.offset) and access:
            self.do_set_access(va, m.size)

    @rule(
        shape=st.sampled_from(("exact", "exact", "lower", "upper", "more", "tiled", "nothing", "around", "gap")),
        pick=PICK,
        n=st.integers(1, 4),
    )
    def unmap(self, shape, pick, n):
        """Unmap one whole mapping, part of one, one and more, several adjacent mappings that tile the range,
        mappings and the gap between them, nothing mapped (and an unmap that succeeded, again). Checks: P-unmap,
        P-unmap-refused."""
        target = self._mapping_range(shape, pick, n)
        if target is not None and self.do_unmap(*target):
            self.do_unmap(*target)  # again, nothing mapped there now: refused

    @rule(
        shape=st.sampled_from(("exact", "exact", "tiled", "part", "whole", "gap", "below", "more", "nothing")),
        pick=PICK,
        n=st.integers(1, 4),
    )
    def set_access(self, shape, pick, n):
        """Grant access to one mapping, part of one, several adjacent ones, a whole reservation, ranges with a gap
        or partly mapped from below or above, nothing mapped. Checks: P-access, P-access-refused."""
        target = self._mapping_range(shape, pick, n)
        if target is not None:
            self.do_set_access(*target)

    def _mapping_range(self, shape: str, pick: int, n: int) -> tuple[int, int] | None:
        g = self.g
        if shape == "nothing":
            va = self._unmapped_granule(pick)
            return None if va is None else (va, g)
        ms = self._mappings()
        if not ms:
            return None
        m = ms[pick % len(ms)]
        k = m.size // g
        if shape in ("lower", "upper", "part") and k < 2:
            return None
        if shape == "tiled":
            chain = self._chain(m)
            return (m.va, chain[min(n, len(chain) - 1)].end - m.va) if len(chain) > 1 else None
        if shape == "gap":
            later = [
                x for x in ms if x.va > m.end and self.model.reservation_at(x.va) is self.model.reservation_at(m.va)
            ]
            return (m.va, later[0].end - m.va) if later else None
        if shape == "whole":
            r = self.model.reservation_at(m.va)
            return r.va, r.size
        cut = 1 + pick // len(ms) % (k - 1) if k > 1 else 1
        return {
            "exact": (m.va, m.size),
            "lower": (m.va, cut * g),
            "upper": (m.va + cut * g, m.size - cut * g),
            "part": (m.va + (cut - 1) * g, g),
            "more": (m.va, m.size + g),
            "below": (m.va - g, m.size + g),
            "around": (m.va - g, m.size + 2 * g),
        }[shape]

    @rule(pick=PICK, start=st.sampled_from(STARTS), length=st.sampled_from(LENGTHS), seed=st.integers(1, 250))
    def write(self, pick, start, length, seed):
        """Write a pattern through a tensor over an unaligned range of accessible bytes, often across granules and
        mappings. Checks: P-tensor, P-tensor-device, P-tensor-keeper, P-map-shared."""
        runs = self.model.accessible_runs()
        if runs:
            self.do_write(*self._run_range(runs, pick, start, length), seed)

    @rule(pick=PICK, seed=st.integers(1, 250))
    def write_through_a_long_tensor(self, pick, seed):
        """One tensor over the longest run of accessible bytes (across many mappings; tens of MiB at 2 MiB granules),
        written near its end, read back through small ones: it aliases the memory, never copies it. Checks:
        P-tensor, P-tensor-device."""
        runs = self.model.accessible_runs()
        if runs:
            lo, hi = max(runs, key=lambda run: run[1] - run[0])
            at = max(hi - 64 - pick * 61 % self.g, lo)
            self.do_write(at, min(64, hi - at), seed, span=(lo, hi - lo))

    @rule(
        pick=PICK,
        start=st.sampled_from(STARTS),
        length=st.sampled_from((*LENGTHS, "rest", "run")),
        seed=st.integers(1, 250),
    )
    def zero(self, pick, start, length, seed):
        """Write a pattern around an unaligned range of accessible bytes (often across granules and mappings, up to
        a whole run of them), then zero the range: exactly its bytes are zero. Checks: P-zero."""
        runs = self.model.accessible_runs()
        if not runs:
            return
        if length == "run":
            va, n = runs[pick % len(runs)][0], runs[pick % len(runs)][1] - runs[pick % len(runs)][0]
        else:
            va, n = self._run_range(runs, pick, start, length)
        lo, hi = next((a, b) for a, b in runs if a <= va < b)
        for a, b in ((max(lo, va - 300), va), (va + n, min(hi, va + n + 300))):
            if a < b:
                self.do_write(a, b - a, seed)
        self.do_zero(va, n)

    @rule(pick=PICK)
    def refusals(self, pick):
        """Every refusal the protocol names, around one reservation and one of its mappings: map past its end,
        before its start, over the mapping from below, from above, inside, exactly and around it, past a handle's
        end, of a released handle, at an offset where the driver maps at 0 only; unmap of part of the mapping, of it
        and more, of adjacent mappings tiling a range, of nothing; access partly mapped from below or above, over a
        gap, over nothing, over part of a mapping where the driver grants whole mappings only; free of part of the
        reservation, around it, of it with mappings, of a freed one; release of a released handle. Each is refused
        and changes nothing. Checks: P-map-inside, P-map-overlap, P-map-handle-end, P-map-released, P-map-offset,
        P-unmap-refused, P-access-refused, P-access, P-free-refused, P-release-once, P-refusal,
        P-refusal-names, P-refusal-unchanged."""
        rs = self._reservations()
        if rs:
            r = rs[pick % len(rs)]
            ms = self.model.mappings_in(r)
            self.refusals_around(r, ms[pick % len(ms)] if ms else None, pick)

    def refusals_around(self, r, m, pick: int) -> None:
        """``refusals`` around the reservation ``r`` and its mapping ``m`` (``None``: none), with the handle and the
        freed range ``pick`` chooses."""
        g = self.g
        live = sorted(self.model.unreleased())
        released = sorted(set(self.model.alive()) - set(live))  # and mapped still: one whose memory is free is gone
        key = live[pick % len(live)] if live else None
        spare = next(iter(self.model.unmapped_runs(r)), (None,))[0]
        calls = [
            ("free", r.va, r.size - g),
            ("free", r.va + g, r.size - g),
            ("free", r.va - g, r.size + 2 * g),
            ("free", r.va, r.size),
        ]
        calls += [("free", *self.freed[pick % len(self.freed)])] if self.freed else []
        if key is not None:
            size = self.model.handles[key].size
            calls += [("map", r.end - g, 2 * g, key, 0), ("map", r.va - g, 2 * g, key, 0)]
            if spare is not None:
                calls += [("map", spare, g, key, size), ("map", spare, g, key, g)]
        if released:
            calls += [("release", released[pick % len(released)])]
            calls += [("map", spare, g, released[pick % len(released)], 0)] if spare is not None else []
        ms = self.model.mappings_in(r)
        if m is not None and key is not None:
            calls += [
                ("map", *where, key, 0)
                for where in (
                    (m.va - g, 2 * g),
                    (m.end - g, 2 * g),
                    (m.va, g),
                    (m.va, m.size),
                    (m.va - g, m.size + 2 * g),
                )
            ]
        if m is not None:
            chain = self._chain(m)
            later = [x for x in ms if x.va > m.end]
            calls += [
                ("unmap", m.va, m.size + g),
                ("unmap", m.va - g, m.size + g),
                ("unmap", m.va - g, m.size + 2 * g),
                ("unmap", m.va, m.size - g),
                ("unmap", m.va + g, m.size - g),
                ("unmap", m.va, chain[-1].end - m.va),
                ("set_access", m.va - g, m.size + g),
                ("set_access", m.va, m.size + g),
                ("set_access", m.va, m.size - g),
            ]
            calls += [("unmap", m.va, later[0].end - m.va), ("set_access", m.va, later[0].end - m.va)] if later else []
        if spare is not None:
            calls += [("unmap", spare, g), ("set_access", spare, g)]
        for op, *args in calls:
            self.refused_call(op, *args)

    def refused_call(self, op: str, *args: int) -> None:
        """``op(*args)`` (handles by key) when the model says it is refused (skipped otherwise)."""
        if any(a <= 0 for a in args[1:2]):
            return
        try:
            prediction = getattr(self.model, op)(*args)
        except CallerError:
            return
        if prediction.refusal is None:
            return
        if op == "map":
            self.call(prediction, *args[:2], self.objects[args[2]], args[3], key=args[2])
        elif op == "release":
            self.call(prediction, self.objects[args[0]], key=args[0])
        else:
            self.call(prediction, *args)

    def _valid_call(self, op: str, pick: int) -> tuple[int, int, int]:
        """``(va, size, offset)`` of a call of ``op`` the protocol takes here, where the state has one: a map into an
        unmapped granule, an unmap or set_access of a whole mapping, a free of a reservation without mappings, a zero
        of an accessible granule; else a range of the first mapping or reservation, or one far from all of them."""
        g, ms, rs = self.g, self._mappings(), self._reservations()
        empty = [r for r in rs if not self.model.mappings_in(r)]
        runs = self.model.accessible_runs()
        found = {
            "map": (self._unmapped_granule(pick), g),
            "unmap": (ms[pick % len(ms)].va, ms[pick % len(ms)].size) if ms else (None, g),
            "set_access": (ms[pick % len(ms)].va, ms[pick % len(ms)].size) if ms else (None, g),
            "free": (empty[pick % len(empty)].va, empty[pick % len(empty)].size) if empty else (None, g),
            "zero": (runs[pick % len(runs)][0], g) if runs else (None, g),
        }.get(op, (None, g))
        if found[0] is None:
            return (ms[pick % len(ms)].va if ms else rs[pick % len(rs)].va if rs else 1 << 40), g, 0
        return found[0], found[1], 0

    def caller_errors(self) -> None:
        """Calls that break a caller's obligation (P-units), each of which a driver may take or refuse: a reservation
        aligned to half a granule past the granularity, to three granules or to half a granule; a handle of a granule
        and a half or of half a granule; a map at half a granule's offset. Refused, the call changes nothing: every
        observable, and on the host what the kernel holds, as before; taken, what it made is given back at once."""
        g, half = self.g, max(self.g // 2, 1)
        va = self._unmapped_granule(0)
        key = next((k for k in self.model.unreleased() if self.model.handles[k].size >= 2 * g), None)
        calls = [("reserve", 2 * g, a) for a in (g + half, 3 * g, half)] + [("create", n) for n in (g + half, half)]
        calls += [("map", va, g, self.objects[key], half)] if va is not None and key is not None else []
        undo = {
            "reserve": lambda result, args: self.raw.free(result, args[0]),
            "create": lambda result, args: self.raw.release(result),
            "map": lambda result, args: self.raw.unmap(args[0], args[1]),
        }
        for op, *args in calls:
            kernel = self._kernel_holds() if self.setup.host else None
            try:
                result = getattr(self.raw, op)(*args)
            except Exception:  # a refusal of any kind: it must change nothing
                if kernel is not None:
                    self._kernel_unchanged(f"{op}({shown(args)}), a caller's error, refused", kernel)
                self.every_observable_matches_the_model()
                continue
            undo[op](result, args)

    @rule(op=st.sampled_from(BAD_VALUE_CALLS), kind=st.sampled_from(BAD_VALUES), pick=PICK)
    def bad_value(self, op, kind, pick):
        """A value that is no int, a size below 1, a negative address or offset, a value or range reaching 2**63:
        refused before any native call, nothing changed, the value named. Checks: P-bad-value, P-refusal,
        P-refusal-names, P-refusal-unchanged."""
        va, size, offset = self._valid_call(op, pick)  # one bad value in a call that is valid otherwise
        g = self.g
        arg, _, what = kind.partition("_")
        if kind == "range_to_2**63":  # each value below 2**63, their sum exactly 2**63
            va, size = MAX_BYTES // 2, MAX_BYTES // 2
        elif kind == "offset_to_2**63":
            offset = MAX_BYTES - va - size
        elif kind == "range_past_2**63":
            va, size = MAX_BYTES - g, 2 * g
        else:
            normal = {"va": va, "size": size, "offset": offset or g}[arg]
            value = {
                "low": 0 if arg == "size" else -1,
                "negative": -g,
                "2**63": MAX_BYTES,
                "false": False,
                "true": True,
                "float": float(normal),
            }[what]
            va, size, offset = (value if arg == a else v for a, v in (("va", va), ("size", size), ("offset", offset)))
        key = self._pick_handle(pick)
        if op == "reserve":  # the offset stands for the alignment here
            args = (size, offset if arg == "offset" else g)
        elif op == "create":
            args = (size,)
        elif op == "map":
            if key is None:
                return
            args = (va, size, key, offset)
        else:
            args = (va, size)
        try:
            prediction = getattr(self.model, op)(*args)
        except CallerError:  # not a bad value for this call, and no call a caller may make
            return
        if prediction.refusal is None:  # not a bad value for this call: the other rules make valid calls
            return
        if op == "zero" and self.setup.host:  # a driver that took it would write where the process owns nothing
            self.call_in_child(prediction, *args)
        else:
            self.call(prediction, *(args[:2] + (self.objects[key], offset) if op == "map" else args))

    @rule()
    def synchronize(self):
        """Checks: P-synchronize."""
        self.call(self.model.synchronize())
