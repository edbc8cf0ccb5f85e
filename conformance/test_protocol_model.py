"""Model-based rules: random sequences of every protocol call, valid and invalid, on the raw driver (the one under the
fixture's Ledger, so its own refusals are reached), compared after every step with the executable model of the
protocol (``protocol_model.py``): ``ProtocolMachine`` (one thread, ``protocol_machine.py``) and ``TwoThreadMachine``
(two threads at once, ``thread_machine.py``). After every step every observable is compared with the model
(``protocol_checks.py``): what each call returned or raised (type and operation), ``mem_info``, ``accessible`` at
every granule of every reservation and just outside, the bytes at every address that shows them (written through
``tensor``, zeroed by ``zero``), and on the host the kernel's own records (``kernel_view.py``: ``/proc/self/maps`` per
granule, the memfds held and open, faults, the address space ``reserve`` takes and ``free`` gives back). After a
refusal the reservations it aimed at must still take a new mapping in each of their unmapped runs.

Examples: ``EXTENSIBLE_KV_PROTOCOL_EXAMPLES`` sets the number of examples of each machine (a stress run sets
thousands); by default the profile's ``max_examples`` sets it (``SEQUENTIAL_SHARE`` and ``THREADED_SHARE`` of it, at
least ``MIN_EXAMPLES``: 12 and 8 in CI, 8 and 8 under the meta-tests' profile), each example at most ``STEPS``
(``THREAD_STEPS``) steps.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import tempfile
import threading
import weakref

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from .helpers import around_powers_of_two, expect, wait_until_gone
from .protocol_checks import NATIVE_LIMITS, Keeper, learn_setup
from .protocol_machine import BAD_VALUE_CALLS, BAD_VALUES, ProtocolMachine
from .protocol_model import MAX_BYTES
from .thread_machine import CONTENDED, OWN_CALLS, TwoThreadMachine

EXAMPLES_ENV = "EXTENSIBLE_KV_PROTOCOL_EXAMPLES"
SEQUENTIAL_SHARE = 0.5  # of the profile's max_examples: 12 in CI (25), 2 under the meta-tests' profile (5)
THREADED_SHARE = 0.3
MIN_EXAMPLES = 8
STEPS = 30
THREAD_STEPS = 12
SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
}


def _examples(share: float) -> int:
    """``EXTENSIBLE_KV_PROTOCOL_EXAMPLES``, else ``share`` of the profile's ``max_examples`` and at least
    ``MIN_EXAMPLES`` (the meta-tests' profile asks for 5 examples of each rule; a machine finds less in fewer)."""
    return int(os.environ.get(EXAMPLES_ENV) or 0) or max(round(settings.default.max_examples * share), MIN_EXAMPLES)


def test_random_protocol_calls_match_the_model(driver):
    """Random sequences of every protocol call, valid and invalid, from one thread. Checks: every sentence id
    (see ProtocolMachine's rules and its invariant)."""
    setup = learn_setup(driver)
    try:
        run_state_machine_as_test(
            lambda: ProtocolMachine(setup),
            settings=settings(
                settings.default, max_examples=_examples(SEQUENTIAL_SHARE), stateful_step_count=STEPS, **SETTINGS
            ),
        )
    except Flaky as exc:  # a failed example left state behind that its replay found (what failed is reported)
        expect(
            False,
            driver,
            "random protocol calls from one thread",
            "every observable as the model says",
            f"{setup.failures[0] if setup.failures else exc} (and the driver kept state across examples, so "
            f"the failing calls could not be replayed)",
        )


def test_calls_from_two_threads_match_some_serial_order(driver):
    """The same kinds of calls from two threads at once. Checks: P-threads (see TwoThreadMachine's rules)."""
    setup = learn_setup(driver)
    try:
        run_state_machine_as_test(
            lambda: TwoThreadMachine(setup),
            settings=settings(
                settings.default, max_examples=_examples(THREADED_SHARE), stateful_step_count=THREAD_STEPS, **SETTINGS
            ),
        )
    except Flaky as exc:  # a race: the same calls failed on one run and not on the next (P-threads)
        first = setup.failures[0] if setup.failures else exc
        expect(
            False,
            driver,
            "calls from two threads",
            "the outcome of some serial order of them on every run",
            f"a failure on some runs of the same calls and not on others (a race), the first: {first}",
        )


CONTENDED_ROUNDS = 4
"""How many times the rule below makes each contended pair of calls."""
PAIRS = {
    **{what: [] for what in CONTENDED},
    **{f"own_{op}": [("map", 0), ("set_access", 0)] for op in OWN_CALLS if op != "free"},
    "own_free": [],
}
"""The pairs of calls of the rule below, each with what each thread does on its own before it (a map of its first
handle at its first granule, with access; nothing before a free of its reservation)."""


def test_every_contended_pair_of_calls_from_two_threads_matches_some_serial_order(driver):
    """Each pair of calls of ``CONTENDED`` (the same call twice on one reservation, mapping or handle, two calls on one,
    one call on two mappings of one handle) and the same call of ``OWN_CALLS`` from each thread on its own resources,
    ``CONTENDED_ROUNDS`` times, made by two threads lined up by a barrier: the rule above samples one or two contended
    pairs per step, this one makes all of them in every run. Each outcome, and the state after both, is that of some
    serial order; every observable checked after each. Checks: P-threads, P-map-overlap, P-unmap-refused,
    P-release-once, P-free-refused, P-release-mapped, P-release-returns, P-mem-exact."""
    machine = TwoThreadMachine(learn_setup(driver))
    try:
        for what, before in PAIRS.items():
            for _ in range(CONTENDED_ROUNDS):
                program = [*before, *[("granularity", 0)] * len(before)]  # ``before`` ahead of the barrier
                machine.two_threads(programs=(program, program), contended=[what])
                machine.every_observable_matches_the_model()
                while machine.model.reservations:  # each round from nothing (two_threads skips past a bound)
                    machine.clear_and_free(pick=0)
                for key in sorted(machine.model.unreleased()):
                    machine.do_release(key)
    finally:
        machine.teardown()


RANGE_SHAPES = {
    "free": ("whole", "lower", "upper", "around", "more", "freed"),
    "map": ("free", "below", "above", "inside", "exact", "around", "past_end", "before_start", "freed"),
    "unmap": ("exact", "lower", "upper", "more", "tiled", "nothing", "around", "gap"),
    "set_access": ("exact", "tiled", "part", "whole", "gap", "below", "more", "nothing"),
}
"""Every shape the random rule's range calls sample from (``ProtocolMachine.free``, ``map``, ``unmap``,
``set_access``), made by the rule below in every run."""


def test_every_shape_of_every_range_call_matches_the_model(driver):
    """Each range call in each shape its random rule samples from (``RANGE_SHAPES``: a range around, past, inside or
    exactly over a reservation or a mapping, a freed one...), at four picks, on a populated driver, each compared with
    the model at once: the random rule draws a handful of these per run, and which ones depends on its examples;
    this one makes all of them in every run. Checks: P-free, P-free-refused, P-map, P-map-inside, P-map-overlap,
    P-map-released, P-unmap, P-unmap-refused, P-access, P-access-refused, P-refusal, P-refusal-unchanged."""
    machine = ProtocolMachine(learn_setup(driver))
    try:
        for op, shapes in RANGE_SHAPES.items():
            for shape in shapes:
                for pick in range(4):  # each of the reservations (the last one empty) and handles in turn
                    machine.populate(sizes=[3, 2], alignment=1, pick=pick)
                    machine.create(granules=2)  # a handle that maps nowhere yet
                    machine.reserve(granules=2, alignment=1)  # an empty reservation: a free that is valid
                    if op == "map":
                        machine.map(shape=shape, pick=pick, n=1 + pick, handle=pick, offset="zero")
                    else:
                        getattr(machine, op)(shape=shape, pick=pick, **({} if op == "free" else {"n": 1 + pick}))
                    machine.every_observable_matches_the_model()
                    while machine.model.reservations:
                        machine.clear_and_free(pick=0)
                    for key in sorted(machine.model.unreleased()):
                        machine.do_release(key)
    finally:
        machine.teardown()


def test_every_bad_value_of_every_call_is_refused_and_named(driver):
    """Every kind of bad value (``BAD_VALUES``: each value of the call below its bound, negative, at 2**63, a bool or a
    float; ranges reaching 2**63) passed to every call that takes it, in a call that is valid otherwise, in turn, each
    compared with the model at once: the table the random rule samples from, all of it in every run; and ``accessible``
    at the ends of the address space, where nothing is reserved: False; then calls that break a caller's obligation
    (``caller_errors``), refused without a trace or taken. Checks: P-bad-value, P-refusal, P-refusal-names,
    P-refusal-unchanged, P-accessible, P-units."""
    machine = ProtocolMachine(learn_setup(driver))
    try:
        machine.populate(sizes=[3, 2], alignment=1, pick=1)
        machine.create(granules=2)
        machine.reserve(granules=2, alignment=1)  # an empty reservation: a free that is valid but for one value
        for op in BAD_VALUE_CALLS:
            for kind in BAD_VALUES:
                for pick in (0, 1):
                    machine.bad_value(op=op, kind=kind, pick=pick)
                    machine.every_observable_matches_the_model()
        for at in (0, 1, MAX_BYTES - machine.g, MAX_BYTES - 1):
            machine.query(machine.model.accessible(at), machine.raw.accessible(at), f"accessible({at:#x})")
        machine.caller_errors()
    finally:
        machine.teardown()


def _foreign_addresses(keep: list) -> list[tuple[str, int]]:
    """Addresses the process maps itself, none of them the driver's: a heap buffer, a shared mapping of a file, an
    anonymous shared mapping, a CPU tensor's memory (``keep`` holds them while the caller asks)."""
    heap = bytearray(1 << 16)
    f = tempfile.TemporaryFile()
    f.truncate(1 << 16)
    shared_file, shared_anon = mmap.mmap(f.fileno(), 1 << 16), mmap.mmap(-1, 1 << 16)
    tensor = torch.zeros(1 << 16, dtype=torch.uint8)
    keep += [f, shared_file, shared_anon, tensor]

    def address(buffer) -> int:
        view = (ctypes.c_char * 1).from_buffer(buffer)
        try:
            return ctypes.addressof(view)
        finally:
            del view

    return [
        ("a heap buffer", address(heap) + 100),
        ("a shared mapping of a file", address(shared_file)),
        ("an anonymous shared mapping", address(shared_anon) + 4096),
        ("a CPU tensor's memory", tensor.data_ptr()),
    ]


def test_what_the_driver_never_made_is_refused_or_not_accessible(driver):
    """With nothing reserved: free, map, unmap and set_access of a range are refused, also on a range reserved and
    freed again; accessible is False at addresses the process maps itself (a heap buffer, a shared file mapping, an
    anonymous shared mapping, a CPU tensor's memory: read-write memory, none of it the driver's). Checks:
    P-free-refused, P-map-inside, P-unmap-refused, P-access-refused, P-refusal, P-refusal-names, P-accessible."""
    machine = ProtocolMachine(learn_setup(driver))
    keep: list = []
    try:
        g = machine.g
        key = machine.do_create(g)
        freed = machine.do_reserve(2 * g, g)
        machine.do_free(freed, 2 * g)
        for va in (1 << 40, freed, freed + g):
            machine.do_free(va, g)
            if key is not None:
                machine.do_map(va, g, key)
            machine.do_unmap(va, g)
            machine.do_set_access(va, g)
            machine.every_observable_matches_the_model()
        for what, at in _foreign_addresses(keep):
            machine.query(machine.model.accessible(at), machine.raw.accessible(at), f"accessible({at:#x}) in {what}")
    finally:
        machine.teardown()
        for obj in keep[:3]:  # the file and the two mappings (the tensor goes with the list)
            obj.close()


def test_exactly_the_free_bytes_can_be_taken(driver):
    """On a driver whose ``mem_info`` is exact (the host): with one granule held, a handle of exactly the free bytes
    is made (memory is short only past them), then one granule more is refused; both given back. Checks:
    P-create-oom, P-create-memory, P-mem-exact."""
    setup = learn_setup(driver)
    if not setup.host:
        pytest.skip("mem_info is exact only on the host: a GPU's free bytes move with every other user")
    machine = ProtocolMachine(setup)
    try:
        g = machine.g
        machine.do_create(g)
        machine.do_create(machine.model.expected_free())
        machine.do_create(g)
        machine.every_observable_matches_the_model()
    finally:
        machine.teardown()


def test_access_to_part_of_a_mapping_covers_that_part_only(driver):
    """A mapping of three granules, access granted to its middle granule, then to its first: only those granules
    are accessible (where the driver grants part of a mapping; elsewhere each call is refused, changing nothing).
    Checks: P-access, P-access-refused, P-accessible."""
    machine = ProtocolMachine(learn_setup(driver))
    try:
        g = machine.g
        va, key = machine.do_reserve(3 * g, g), machine.do_create(3 * g)
        if va is not None and key is not None and machine.do_map(va, 3 * g, key):
            for start in (va + g, va):
                machine.do_set_access(start, g)
                machine.every_observable_matches_the_model()
    finally:
        machine.teardown()


NEIGHBOURS = {"without access": False, "accessible": True}
"""The state of the two mappings around every range of the sweep below: what a call there does must not depend on
it (a driver that merges a new mapping with an accessible neighbour, or takes its access along, differs only here)."""


@pytest.mark.parametrize("neighbours", NEIGHBOURS)
def test_every_range_over_mappings_and_gaps_is_judged_as_the_model_says(driver, neighbours):
    """A reservation of seven granules holding a mapping of three granules at its second granule and one of one
    granule at its sixth (unmapped granules before, between and after them), both without access or both accessible
    (``NEIGHBOURS``), and every range of whole granules from one granule before the reservation to one past it:
    set_access, unmap (mapped again when taken, and given access again when the mappings are accessible), map of a
    fresh handle (unmapped again when taken) and free, each judged against the model (taken, or refused naming a
    value) and every observable checked after each range: every start and end that a driver's range arithmetic can
    get wrong, at every boundary, next to mappings in either state. Checks: P-access, P-access-refused, P-unmap,
    P-unmap-refused, P-map, P-map-no-access, P-map-overlap, P-map-inside, P-free-refused, P-refusal-names,
    P-refusal-unchanged."""
    accessible = NEIGHBOURS[neighbours]
    machine = ProtocolMachine(learn_setup(driver))
    try:
        g = machine.g
        va, a, b = machine.do_reserve(7 * g, g), machine.do_create(3 * g), machine.do_create(g)
        if va is None or a is None or b is None or not machine.do_map(va + g, 3 * g, a):
            return
        machine.do_map(va + 5 * g, g, b)
        if accessible:
            machine.do_set_access(va + g, 3 * g)
            machine.do_set_access(va + 5 * g, g)
        for lo in range(-1, 7):
            for hi in range(lo + 1, 9):
                start, size = va + lo * g, (hi - lo) * g
                machine.do_set_access(start, size)
                mapping = machine.model.mappings.get(start)
                if machine.do_unmap(start, size):
                    machine.do_map(start, size, mapping.handle, mapping.offset)
                    if accessible:
                        machine.do_set_access(start, size)
                key = machine.do_create(size)
                if key is not None:
                    if machine.do_map(start, size, key):
                        machine.every_observable_matches_the_model()
                        machine.do_unmap(start, size)
                    machine.do_release(key)
                machine.do_free(start, size)
                machine.every_observable_matches_the_model()
    finally:
        machine.teardown()


RESERVE_GRANULES = (1, 2, 3, *around_powers_of_two(4, 6, 9))
"""Sizes on each side of those where a kernel or a driver may change how it places a range (huge pages, a cache of
small ranges, a fast path for large ones)."""
RESERVE_ALIGNMENTS = (1, 2, 4, 64)


def test_reservations_of_every_size_class_are_aligned_exact_and_disjoint(driver):
    """Reservations of 1 to 513 granules (``RESERVE_GRANULES``) at alignments of 1, 2, 4 and 64 granules, three of
    each held at once: each aligned, disjoint from the others and from every live reservation, on the host exactly its
    range in the kernel's maps; then freed, the address space given back, and every observable as the model says.
    Checks: P-reserve-aligned, P-reserve-disjoint, P-reserve-kernel, P-free, P-free-kernel."""
    machine = ProtocolMachine(learn_setup(driver))
    try:
        g = machine.g
        for n in RESERVE_GRANULES:
            for alignment in RESERVE_ALIGNMENTS:
                vas = [machine.do_reserve(n * g, alignment * g) for _ in range(3)]
                for va in vas:
                    if va is not None:
                        machine.do_free(va, n * g)
        machine.every_observable_matches_the_model()
    finally:
        machine.teardown()


def test_a_handle_mapped_in_parts_is_held_until_its_last_mapping_goes(driver):
    """A handle of three granules mapped in parts (where the driver takes offsets: granule by granule at its own
    offsets, and two granules of it again at a second address), released, then unmapped one mapping at a time in each
    order: its memory is held, and every observable as the model says, until its last mapping goes; whole-handle
    mappings where the driver takes no offsets. Checks: P-release-mapped, P-release-returns, P-mem-exact,
    P-map-offset, P-map-shared, P-unmap."""
    setup = learn_setup(driver)
    for order in (1, -1):
        machine = ProtocolMachine(setup)
        try:
            g = machine.g
            va, other, key = machine.do_reserve(3 * g, g), machine.do_reserve(2 * g, g), machine.do_create(3 * g)
            if va is None or other is None or key is None:
                return
            if machine.model.offsets and machine.model.parts:
                parts = [(va + i * g, g, i * g) for i in range(3)] + [(other, 2 * g, g)]
            else:
                parts = [(va, 3 * g, 0)]
            for at, size, offset in parts:
                machine.do_map(at, size, key, offset)
            machine.do_release(key)
            machine.every_observable_matches_the_model()
            for at, size, _ in parts[::order]:
                machine.do_unmap(at, size)
                machine.every_observable_matches_the_model()
        finally:
            machine.teardown()


NEW_THREAD_WAIT_S = 60.0
"""How long one call made from a new thread may take before the rule says it hangs."""


def test_every_call_from_a_thread_new_to_the_driver_is_taken(driver):
    """A whole life (reserve, create, map at an offset where the driver maps at one, set_access, a write through a
    tensor, zero, unmap, release, free), each call made from a new thread that never called the driver before, every
    observable checked from the main thread after each: a driver keeping state per thread (a current context, a
    stream, a cache) must set it up in whichever thread calls. Checks: P-threads, P-map, P-access, P-zero, P-unmap,
    P-release-returns, P-free."""
    machine = ProtocolMachine(learn_setup(driver))

    def in_a_new_thread(what: str, step):
        out: list = []

        def run() -> None:
            try:
                out.append((True, step()))
            except BaseException as exc:  # handed to the main thread as it came
                out.append((False, exc))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(NEW_THREAD_WAIT_S)
        expect(bool(out), driver, f"{what} from a new thread", f"done within {NEW_THREAD_WAIT_S:.0f} s", "waiting")
        wait_until_gone([thread])
        done, value = out[0]
        if not done:
            raise value
        machine.every_observable_matches_the_model()
        return value

    try:
        g = machine.g
        va = in_a_new_thread("reserve", lambda: machine.do_reserve(4 * g, g))
        key = in_a_new_thread("create", lambda: machine.do_create(3 * g))
        expect(va is not None and key is not None, driver, "reserve and create from new threads", "taken", (va, key))
        at, size, offset = (va + g, 2 * g, g) if machine.model.offsets and machine.model.parts else (va, 3 * g, 0)
        mapped = in_a_new_thread("map", lambda: machine.do_map(at, size, key, offset))
        expect(mapped, driver, f"map({at:#x}, {size}, offset {offset}) from a new thread", "taken", "refused")
        in_a_new_thread("set_access", lambda: machine.do_set_access(at, size))
        in_a_new_thread("a write through a tensor", lambda: machine.do_write(at + 5, size - 9, seed=7))
        in_a_new_thread("zero", lambda: machine.do_zero(at + g, g))
        in_a_new_thread("unmap", lambda: machine.do_unmap(at, size))
        in_a_new_thread("release", lambda: machine.do_release(key))
        in_a_new_thread("free", lambda: machine.do_free(va, 4 * g))
    finally:
        machine.teardown()


MANY_MAPPINGS = 40
"""Mappings alive at once in the rule below: past the sizes (16, 32) where a driver's table or fast path may change."""


def test_overlaps_are_refused_with_dozens_of_mappings_alive(driver):
    """Forty two-granule mappings of one handle alive at once in one reservation, a free granule after each; then, next
    to the 1st, 16th, 17th, 32nd, 33rd and last of them, a fresh handle mapped over it from the granule below and from
    its second granule (a range starting inside it): each refused as the model says, changing nothing, and every
    observable checked with all forty alive. Checks: P-map-overlap, P-refusal-unchanged, P-map-shared."""
    machine = ProtocolMachine(learn_setup(driver))
    try:
        g = machine.g
        va, shared, other = (
            machine.do_reserve(3 * MANY_MAPPINGS * g, g),
            machine.do_create(2 * g),
            machine.do_create(2 * g),
        )
        if va is None or shared is None or other is None:
            return
        for i in range(MANY_MAPPINGS):
            machine.do_map(va + 3 * i * g, 2 * g, shared)
        for i in (0, 15, 16, 31, 32, MANY_MAPPINGS - 1):
            start = va + 3 * i * g
            for at in ((start - g,) if i else ()) + (start + g,):
                expect(
                    not machine.do_map(at, 2 * g, other),
                    machine.driver,
                    f"map({at:#x}, {2 * g}) over mapping {i + 1} of {MANY_MAPPINGS} alive",
                    "refused",
                    "taken",
                )
        machine.every_observable_matches_the_model()
    finally:
        machine.teardown()


HANDLE_GRANULES = (1, 2, 3, *around_powers_of_two(4, 5))
"""Handle sizes on each side of those where a driver may change how it makes or maps a handle (chunked handles, a
large-handle path)."""


@pytest.mark.parametrize("granules", HANDLE_GRANULES)
def test_handles_of_every_size_class_map_whole_in_parts_and_at_offsets(driver, granules):
    """A handle of ``granules`` granules (``HANDLE_GRANULES``) mapped whole, then (where the driver maps parts, and at
    offsets) its first granule, its last granule at its offset and its middle at the offset of its second granule,
    each at its place in a reservation of the handle's size, given access and written, each judged against the model,
    every observable checked with the last piece mapped; then, its last mapping gone, the whole handle mapped again
    with access into a new reservation: every byte written through any piece is still there (a driver may not drop
    the pages of a handle it holds, at any size); then everything given back. Checks: P-map, P-map-offset,
    P-map-handle-end, P-access, P-create-memory, P-map-remap, P-release-returns."""
    machine = ProtocolMachine(learn_setup(driver))
    try:
        g, n = machine.g, granules
        va, key = machine.do_reserve(n * g, g), machine.do_create(n * g)
        if va is None or key is None:
            return
        pieces = [(0, n)]
        if machine.model.parts:
            pieces += [(0, 1), (n - 1, 1)] + ([(1, n - 2)] if n > 2 else [])
        for first, count in pieces:
            at, size, offset = va + first * g, count * g, first * g
            if offset and not machine.model.offsets:
                continue
            expect(
                machine.do_map(at, size, key, offset),
                machine.driver,
                f"map of granules {first}..{first + count - 1} of a {n}-granule handle at offset {offset}",
                "taken",
                "refused",
            )
            machine.do_set_access(at, size)
            machine.do_write(at + 3, min(size - 7, 3 * 4096), seed=first + n)
            if (first, count) == pieces[-1]:  # once per handle (each check reads every byte): the last piece mapped
                machine.every_observable_matches_the_model()
            machine.do_unmap(at, size)
        again = machine.do_reserve(n * g, g)
        expect(
            again is not None and machine.do_map(again, n * g, key),
            machine.driver,
            f"a {n}-granule handle mapped nowhere, mapped again whole into a new reservation",
            "taken",
            "refused",
        )
        machine.do_set_access(again, n * g)
        machine.every_observable_matches_the_model()
        machine.do_unmap(again, n * g)
        machine.do_free(again, n * g)
        machine.do_release(key)
        machine.do_free(va, n * g)
        machine.every_observable_matches_the_model()
    finally:
        machine.teardown()


LIVE_COUNTS = {
    "mappings": around_powers_of_two(*range(4, 11)),
    "handles": around_powers_of_two(*range(4, 9)),
    "reservations": around_powers_of_two(*range(4, 10)),
    "tensors": around_powers_of_two(*range(4, 11)),
}
"""How many mappings, handles, reservations (each with a mapping) or tensors the rule below holds alive when it probes
the driver: each side of every power of two from 16 up (mappings and tensors to 1025; handles to 257, each an open
file on the host, under the usual limit of 1024; reservations to 513), the counts at which a driver's table, cache or
fast path may change."""


@pytest.mark.parametrize("what", LIVE_COUNTS)
def test_every_call_is_judged_as_the_model_says_at_every_count_of_live_objects(driver, what):
    """Mappings (two-granule mappings of one handle, without access), handles (one granule each), reservations (two
    granules each, the first mapped) or tensors (each with its own keeper) made one at a time and kept alive; at each
    count of ``LIVE_COUNTS`` the newest, one made halfway and the oldest are probed, each call judged against the model:
    a mapping's access before and after ``set_access``, a write through a tensor, at each count one past a power of two
    every refusal the protocol names around it and its reservation (``refusals_around``: parts, overlaps, frees with
    mappings, ...), an unmap and a map again at the same place (without access until granted again), a map over it
    refused; a handle mapped, granted, written and unmapped, an older one released; a reservation mapped into and
    cleared, the refusals around it again with nothing mapped in it, an older one freed and reserved again; a tensor's
    keeper held and its address; ``mem_info`` after each. Every observable is checked with the most alive. Checks:
    P-accessible, P-map, P-map-no-access, P-map-remap, P-map-shared, P-map-overlap, P-access, P-tensor, P-tensor-keeper,
    P-unmap, P-unmap-refused, P-free-refused, P-refusal-unchanged, P-mem-exact, P-create-memory, P-release-returns,
    P-reserve-disjoint, P-reserve-inaccessible, P-free, P-free-kernel."""
    counts = LIVE_COUNTS[what]
    machine = ProtocolMachine(learn_setup(driver))
    try:
        g = machine.g
        top = counts[-1]
        size = 2 * g if what == "mappings" else g  # the size of each mapping made (whole handles on every driver)
        spare = machine.do_reserve((2 * top + 2 if what == "mappings" else 2) * g, g)
        shared, other = machine.do_create(size), machine.do_create(size)
        expect(
            None not in (spare, shared, other),
            driver,
            f"a reservation for {top} mappings and two handles of {size} bytes",
            "made",
            (spare, shared, other),
        )
        tensors = _Tensors(machine, spare, shared) if what == "tensors" else None
        made: list = []
        for n in range(1, top + 1):
            if what == "mappings":
                at = spare + 2 * (n - 1) * g
                made.append(at if machine.do_map(at, size, shared) else None)
            elif what == "handles":
                made.append(machine.do_create(g))
            elif what == "reservations":
                made.append(_mapped_reservation(machine, shared))
            else:
                made.append(tensors.make(n))
            if made[-1] is None:  # memory or address space ran out (the model judged the refusal): as far as it goes
                break
            if n in counts:
                past = (n - 1) & (n - 2) == 0  # one past a power of two: the refusals too
                for i in sorted({n - 1, n // 2, 0}, reverse=True):
                    _probe(machine, what, made, i, spare, shared, other, tensors, seed=n + i, refusals=past)
                machine.call(machine.model.mem_info())
        machine.every_observable_matches_the_model()
    finally:
        machine.teardown()


def _mapped_reservation(machine: ProtocolMachine, key: int) -> int | None:
    """A new two-granule reservation with the one-granule handle ``key`` mapped at its first granule, or ``None``."""
    va = machine.do_reserve(2 * machine.g, machine.g)
    return va if va is not None and machine.do_map(va, machine.g, key) else None


class _Tensors:
    """The tensors of the rule above, over one accessible granule of ``spare``: each 64 bytes at its own place, with a
    keeper of its own, which its storage must hold while it lives (P-tensor-keeper)."""

    def __init__(self, machine: ProtocolMachine, spare: int, key: int) -> None:
        self.machine, self.spare = machine, spare
        machine.do_map(spare, machine.g, key)
        machine.do_set_access(spare, machine.g)
        self.kept: dict[int, tuple[torch.Tensor, weakref.ref, int]] = {}

    def make(self, n: int) -> int:
        va = self.spare + n * 64 % (self.machine.g - 64)
        keeper = Keeper()
        self.kept[n] = (self.machine.raw.tensor(va, 64, keeper), weakref.ref(keeper), va)
        return n

    def probe(self, n: int, of: int) -> None:
        t, alive, va = self.kept[n]
        got = {"keeper alive": alive() is not None, "data_ptr": t.data_ptr(), "numel": t.numel()}
        want = {"keeper alive": True, "data_ptr": va, "numel": 64}
        expect(
            got == want,
            self.machine.driver,
            f"tensor({va:#x}, 64, keeper) {n} of {of} alive (the others made since kept alive)",
            want,
            got,
        )


def _probe(machine, what: str, made: list, i: int, spare: int, shared: int, other: int, tensors, seed: int, refusals):
    """The calls the rule above makes on the ``i``-th live object it made (``made[i]``), each judged by the model (with
    ``refusals``, every refusal around it too)."""
    g = machine.g

    def refused_around(va: int, at: int | None) -> None:
        if refusals:
            machine.refusals_around(machine.model.reservations[va], machine.model.mappings.get(at), seed)

    def ask(va: int, where: str) -> None:
        machine.query(machine.model.accessible(va), machine.raw.accessible(va), f"accessible({va:#x}), {where}")

    if what == "tensors":
        tensors.probe(made[i], len(made))
        return
    if what == "mappings":
        at = made[i]
        ask(at, f"mapping {i + 1} of {len(made)}")
        machine.do_set_access(at, 2 * g)
        machine.do_write(at + g - 5, 64, seed)
        refused_around(spare, at)
        machine.do_unmap(at, 2 * g)
        ask(at, f"mapping {i + 1} unmapped")
        machine.do_map(at, 2 * g, shared)
        ask(at, f"mapping {i + 1} of {len(made)} mapped again")
        machine.do_set_access(at, 2 * g)
        ask(at + g, f"mapping {i + 1} of {len(made)} granted again")
        machine.do_map(at, 2 * g, other)  # over a live mapping: refused
        return
    if what == "handles":
        key = made[i]
        if key is None or key not in machine.model.unreleased():
            return
        if machine.do_map(spare, g, key):
            machine.do_set_access(spare, g)
            machine.do_write(spare + 7, 64, seed)
            refused_around(spare, spare)
            machine.do_unmap(spare, g)
        if i != len(made) - 1 and machine.do_release(key):
            made[i] = machine.do_create(g)  # as many alive again, the new one made right after a release
        return
    va = made[i]
    if va is None or va not in machine.model.reservations:
        return
    ask(va, f"reservation {i + 1} of {len(made)}, mapped without access")
    ask(va + g, f"reservation {i + 1} of {len(made)}, its unmapped granule")
    if machine.do_map(va + g, g, other):
        machine.do_set_access(va + g, g)
        machine.do_write(va + g + 9, 64, seed)
        machine.do_unmap(va + g, g)
    refused_around(va, va)
    if not machine.do_unmap(va, g):
        return
    refused_around(va, None)  # with nothing mapped in it
    if i != len(made) - 1 and machine.do_free(va, 2 * g):
        made[i] = _mapped_reservation(machine, shared)
    else:
        machine.do_map(va, g, shared)  # as it was


LIFECYCLE_STEPS = ("remap", "release", "alias", "unmap")
"""What may happen to a written handle while none of its bytes is on view: a remap of its first mapping (unmapped
and mapped again without access), its release, a mapping at a second address (without access), the unmap of its
first mapping."""


@pytest.mark.parametrize("order", list(itertools.permutations(LIFECYCLE_STEPS)), ids="-".join)
def test_a_handles_bytes_survive_every_order_of_remap_release_alias_and_unmap(driver, order):
    """A two-granule handle mapped whole with access and written across both granules, then the steps of
    ``LIFECYCLE_STEPS`` in every order (24), each judged against the model (a released handle mapped nowhere is
    gone; one released may not be mapped again): whatever mappings of it are left are granted access, and an
    unreleased handle mapped nowhere is mapped again; its bytes are the ones written, through every mapping (every
    observable checked). A driver may do what it likes with memory no one sees, except lose it. Checks:
    P-release-mapped, P-map-remap, P-map-shared, P-map-no-access, P-map-released, P-unmap, P-release-returns."""
    machine = ProtocolMachine(learn_setup(driver))
    try:
        g = machine.g
        first, second, key = machine.do_reserve(2 * g, g), machine.do_reserve(2 * g, g), machine.do_create(2 * g)
        expect(
            None not in (first, second, key) and machine.do_map(first, 2 * g, key),
            driver,
            "two reservations of two granules and a two-granule handle mapped into the first",
            "made",
            (first, second, key),
        )
        machine.do_set_access(first, 2 * g)
        machine.do_write(first + 3, 2 * g - 6, seed=len(order[0]) + 11)
        handle = machine.model.handles[key]
        for step in order:  # a handle that is gone is never passed again (P-release-once)
            mapped = first in machine.model.mappings
            if step == "remap" and mapped and machine.do_unmap(first, 2 * g) and handle.alive:
                machine.do_map(first, 2 * g, key)
            elif step == "release" and handle.alive:
                machine.do_release(key)
            elif step == "alias" and handle.alive:
                machine.do_map(second, 2 * g, key)
            elif step == "unmap" and mapped:
                machine.do_unmap(first, 2 * g)
        shown = [m.va for m in machine.model.mappings.values() if m.handle == key]
        if not shown and key in machine.model.unreleased():
            shown = [first] if machine.do_map(first, 2 * g, key) else []
        for va in shown:
            machine.do_set_access(va, 2 * g)
        machine.every_observable_matches_the_model()
    finally:
        machine.teardown()


LARGE_ALIGNMENT = 1 << 36
"""An alignment (64 GiB) whose padding no limit of ``NATIVE_LIMITS`` leaves room for."""


@pytest.mark.parametrize("limit", NATIVE_LIMITS)
def test_every_call_the_kernel_refuses_natively_is_a_driver_error_that_leaves_nothing(driver, limit):
    """On the host, under each kernel limit of ``NATIVE_LIMITS`` in turn (no new file descriptor, no file larger than a
    byte, at most 1 MiB or 1 GiB more address space): a create of one granule and of 16 MiB, a reserve of 16 MiB, and
    of a granule and of 16 MiB aligned to ``LARGE_ALIGNMENT`` (each freed if taken), a map and a set_access; each
    refused as a ``DriverError`` naming the call, changing nothing (no memfd, descriptor, byte or
    address space kept), or taken where the driver needs none of what the limit withholds; every observable checked
    after the limit is lifted. Every native step of a call can fail, not only the first. Checks: P-native-failure,
    P-refusal, P-refusal-unchanged, P-create-memory, P-reserve-kernel."""
    setup = learn_setup(driver)
    if not setup.host:
        pytest.skip("the kernel's resource limits fail the host driver's native calls; a GPU driver's fail elsewhere")
    machine = ProtocolMachine(setup)
    try:
        g = machine.g
        big = max(-(-(16 << 20) // g), 2) * g  # more than the address space the last limit leaves
        va, key = machine.do_reserve(2 * g, g), machine.do_create(g)
        expect(None not in (va, key), driver, "a two-granule reservation and a one-granule handle", "made", (va, key))
        machine.do_create(g, limit=limit)
        machine.do_create(big, limit=limit)
        for size, alignment in [(big, g), *((n, LARGE_ALIGNMENT) for n in (g, big))]:
            made = machine.do_reserve(size, alignment, limit=limit)
            if made is not None:
                machine.do_free(made, size)
        if machine.do_map(va, g, key, limit=limit):
            machine.do_set_access(va, g, limit=limit)
        machine.every_observable_matches_the_model()
    finally:
        machine.teardown()
