"""The Ledger: protocol checks that stop a broken caller before the inner driver, fault injection, bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver, HostHandle
from extensible_kv.drivers.ledger import OPERATIONS, Call, Outstanding
from extensible_kv.errors import DriverError, DriverOutOfMemory, ProtocolViolation

G = 4096


class RecordingHost(HostDriver):
    """A 4 KiB host driver that records every protocol call reaching it (in ``seen``)."""

    def __init__(self) -> None:
        super().__init__(granularity=G, name="recording-host")
        self.seen: list[str] = []


def _recorded(op: str):
    def method(self, *args, **kwargs):
        self.seen.append(op)
        return getattr(HostDriver, op)(self, *args, **kwargs)

    return method


for _op in OPERATIONS:
    setattr(RecordingHost, _op, _recorded(_op))


@pytest.fixture
def ledger():
    """An empty Ledger over a RecordingHost; afterwards everything left is unmapped, released and freed."""
    led = Ledger(RecordingHost())
    yield led
    for va, size in led.outstanding().mappings.items():
        led.unmap(va, size)
    for handle, _ in list(led.handles.values()):
        led.release(handle)
    for va, size in led.outstanding().reservations.items():
        led.free(va, size)
    inner = led.inner
    assert not led.outstanding() and not inner._mappings and not inner._reservations, (
        f"ledger teardown: expected nothing left, got {led.outstanding()}, inner mappings {inner._mappings}, "
        f"inner reservations {inner._reservations}"
    )


@dataclass
class World:
    ledger: Ledger
    inner: RecordingHost
    va: int  # a 4-granule reservation whose first 2 granules are mapped (from `mapped`) and accessible
    mapped: HostHandle
    spare: HostHandle  # a live 2-granule handle, not mapped
    empty: int  # a 2-granule reservation with nothing mapped
    foreign: HostHandle  # a handle created on the inner driver behind the ledger's back


@pytest.fixture
def world(ledger):
    inner = ledger.inner
    va = ledger.reserve(4 * G, G)
    mapped = ledger.create(2 * G)
    ledger.map(va, 2 * G, mapped)
    ledger.set_access(va, 2 * G)
    w = World(ledger, inner, va, mapped, ledger.create(2 * G), ledger.reserve(2 * G, G), inner.create(G))
    yield w
    inner.release(w.foreign)


def state(w: World) -> tuple:
    """Everything a call that reached the inner driver (or the ledger's books) would change."""
    return (
        list(w.inner.seen),
        dict(w.inner._mappings),
        dict(w.inner._reservations),
        len(w.ledger.calls),
        w.ledger.outstanding(),
        [w.inner.accessible(w.va + k * G) for k in range(4)],
    )


NOT_A_MULTIPLE = f"not a positive multiple of the granularity {G}"
# Each misuse, and the message it must get: the driver's name, the operation and the values (``{va}`` and
# ``{empty}`` are the world's addresses, ``{foreign}`` its foreign handle).
VIOLATIONS = {
    "reserve misaligned size": (lambda w: w.ledger.reserve(G + 1, G), f"reserve with size={G + 1}: {NOT_A_MULTIPLE}"),
    "create misaligned size": (lambda w: w.ledger.create(G // 2), f"create with size={G // 2}: {NOT_A_MULTIPLE}"),
    "create zero size": (lambda w: w.ledger.create(0), f"create with size=0: {NOT_A_MULTIPLE}"),
    "map misaligned va": (
        lambda w: w.ledger.map(w.va + 2 * G + 1, G, w.spare),
        "map with va={va+2G+1:#x}: " + NOT_A_MULTIPLE,
    ),
    "map misaligned size": (
        lambda w: w.ledger.map(w.va + 2 * G, G + 1, w.spare),
        f"map with size={G + 1}: {NOT_A_MULTIPLE}",
    ),
    "map misaligned va and size": (
        lambda w: w.ledger.map(w.va + 2 * G + 1, G + 1, w.spare),
        "map with va={va+2G+1:#x}, " + f"size={G + 1}: {NOT_A_MULTIPLE}",
    ),
    "map misaligned offset": (
        lambda w: w.ledger.map(w.va + 2 * G, G, w.spare, 1),
        f"map with offset=1: {NOT_A_MULTIPLE}",
    ),
    "map past the handle": (
        lambda w: w.ledger.map(w.va + 2 * G, 2 * G, w.spare, G),
        f"map offset {G} + size {2 * G} exceeds the {2 * G}-byte handle",
    ),
    "map outside a reservation": (
        lambda w: w.ledger.map(w.va + 4 * G, G, w.spare),
        "map [{va+4G:#x}, +" + f"{G}) is outside every live reservation",
    ),
    "map straddling a reservation end": (
        lambda w: w.ledger.map(w.va + 3 * G, 2 * G, w.spare),
        "map [{va+3G:#x}, +" + f"{2 * G}) is outside every live reservation",
    ),
    "map overlapping a live mapping": (
        lambda w: w.ledger.map(w.va + G, 2 * G, w.spare),
        "map [{va+G:#x}, +"
        + f"{2 * G}) overlaps the live mapping "
        + "[{va:#x}, +"
        + f"{2 * G}): a granule would be mapped twice",
    ),
    "map of a handle the ledger did not create": (
        lambda w: w.ledger.map(w.va + 2 * G, G, w.foreign),
        "map of a handle that is not live: {foreign!r}",
    ),
    "unmap first half of a mapping": (
        lambda w: w.ledger.unmap(w.va, G),
        "unmap({va:#x}, " + f"{G}) is not exactly one live mapping",
    ),
    "unmap second half of a mapping": (
        lambda w: w.ledger.unmap(w.va + G, G),
        "unmap({va+G:#x}, " + f"{G}) is not exactly one live mapping",
    ),
    "unmap more than a mapping": (
        lambda w: w.ledger.unmap(w.va, 3 * G),
        "unmap({va:#x}, " + f"{3 * G}) is not exactly one live mapping",
    ),
    "reserve off the granularity's alignment": (
        lambda w: w.ledger.reserve(G, G + G // 2),
        f"reserve with alignment={G + G // 2}: {NOT_A_MULTIPLE}",
    ),
    "set_access misaligned va": (
        lambda w: w.ledger.set_access(w.va + 1, G),
        "set_access with va={va+1:#x}: " + NOT_A_MULTIPLE,
    ),
    "set_access misaligned size": (
        lambda w: w.ledger.set_access(w.va, G + 1),
        f"set_access with size={G + 1}: {NOT_A_MULTIPLE}",
    ),
    "set_access over a partly mapped range": (
        lambda w: w.ledger.set_access(w.va, 3 * G),
        "set_access [{va:#x}, +" + f"{3 * G}) covers only {2 * G} mapped bytes",
    ),
    "free with live mappings": (
        lambda w: w.ledger.free(w.va, 4 * G),
        "free({va:#x}, " + f"{4 * G}) with 1 live mapping(s)",
    ),
    "free with the wrong size": (
        lambda w: w.ledger.free(w.empty, G),
        "free({empty:#x}, " + f"{G}) is not exactly one live reservation",
    ),
    "free of an unknown address": (
        lambda w: w.ledger.free(w.empty + G, G),
        "free({empty+G:#x}, " + f"{G}) is not exactly one live reservation",
    ),
    "release of an unknown handle": (
        lambda w: w.ledger.release(w.foreign),
        "release of a handle that is not live: {foreign!r}",
    ),
}


def _message(w: World, template: str) -> str:
    """The expected message: the driver's name, then ``template`` with the world's addresses filled in."""
    values = {
        "va": w.va,
        "va+1": w.va + 1,
        "va+G": w.va + G,
        "va+2G+1": w.va + 2 * G + 1,
        "va+3G": w.va + 3 * G,
        "va+4G": w.va + 4 * G,
        "empty": w.empty,
        "empty+G": w.empty + G,
    }
    text = template.replace("{foreign!r}", repr(w.foreign))
    for key, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        text = text.replace("{" + key + ":#x}", f"{value:#x}")
    return f"{w.ledger.inner.name}: {text}"


@pytest.mark.parametrize("case", VIOLATIONS, ids=list(VIOLATIONS))
def test_protocol_violation_is_raised_before_the_inner_driver_is_touched(world, case):
    call, template = VIOLATIONS[case]
    before = state(world)
    with pytest.raises(ProtocolViolation) as info:
        call(world)
    after = state(world)
    assert after == before, f"Ledger, {case}: expected ProtocolViolation with nothing changed ({before}), got {after}"
    expected = _message(world, template)
    assert str(info.value) == expected, f"Ledger, {case}: expected the message {expected!r}, got {str(info.value)!r}"


def test_release_twice_is_a_protocol_violation(world):
    world.ledger.release(world.spare)
    before = state(world)
    with pytest.raises(ProtocolViolation):
        world.ledger.release(world.spare)
    assert state(world) == before, f"Ledger.release twice: expected nothing changed ({before}), got {state(world)}"


VALID_CALLS = {
    "reserve": lambda w: w.ledger.reserve(G, G),
    "free": lambda w: w.ledger.free(w.empty, 2 * G),
    "create": lambda w: w.ledger.create(G),
    "release": lambda w: w.ledger.release(w.spare),
    "map": lambda w: w.ledger.map(w.va + 2 * G, G, w.spare),
    "unmap": lambda w: w.ledger.unmap(w.va, 2 * G),
    "set_access": lambda w: w.ledger.set_access(w.va, 2 * G),
    "zero": lambda w: w.ledger.zero(w.va, G),
    "synchronize": lambda w: w.ledger.synchronize(),
}


@pytest.mark.parametrize("op", OPERATIONS)
def test_injected_failure_raises_driver_error_without_reaching_the_inner_driver(world, op):
    world.ledger.fail(op)
    seen, books = list(world.inner.seen), world.ledger.outstanding()
    with pytest.raises(DriverError) as info:
        VALID_CALLS[op](world)
    got = (info.type, info.value.operation, world.inner.seen, world.ledger.outstanding())
    assert got == (DriverError, op, seen, books), (
        f"Ledger.fail({op!r}) then {op}: expected (DriverError, {op!r}, {seen}, {books}), got {got}"
    )
    VALID_CALLS[op](world)
    assert world.inner.seen == [*seen, op], (
        f"Ledger.fail({op!r}): expected the retry of {op} to reach the inner driver, inner saw {world.inner.seen}"
    )


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_fail_nth_makes_exactly_the_nth_next_call_fail(ledger, nth):
    ledger.fail("create", nth)
    outcomes = []
    for _ in range(nth + 2):
        try:
            ledger.create(G)
            outcomes.append("ok")
        except DriverError as exc:
            outcomes.append(exc.operation)
    expected = ["ok"] * (nth - 1) + ["create", "ok", "ok"]
    assert outcomes == expected and ledger.inner.seen == ["create"] * (nth + 1), (
        f"Ledger.fail('create', {nth}) then {nth + 2} creates: expected {expected} with {nth + 1} reaching the "
        f"inner driver, got {outcomes} with inner calls {ledger.inner.seen}"
    )


def test_fail_raises_the_given_error(ledger):
    error = DriverOutOfMemory("create", "test-injected")
    ledger.fail("create", error=error)
    with pytest.raises(DriverOutOfMemory) as info:
        ledger.create(G)
    assert info.value is error, f"Ledger.fail('create', error={error!r}): expected that error, got {info.value!r}"


@pytest.mark.parametrize(("op", "nth"), [("tensor", 1), ("bogus", 1), ("create", 0), ("create", -1)])
def test_fail_rejects_unknown_operations_and_nth_below_one(ledger, op, nth):
    with pytest.raises(ValueError):
        ledger.fail(op, nth)
    ledger.create(G)  # nothing was armed
    assert ledger.inner.seen == ["create"], (
        f"Ledger.fail({op!r}, {nth}): expected a later create to reach the driver, inner saw {ledger.inner.seen}"
    )


def test_outstanding_reflects_reservations_handles_and_mappings(ledger):
    got = [ledger.outstanding()]
    va = ledger.reserve(2 * G, G)
    got.append(ledger.outstanding())
    handle = ledger.create(G)
    got.append(ledger.outstanding())
    ledger.map(va + G, G, handle)
    got.append(ledger.outstanding())
    ledger.release(handle)  # a live mapping keeps its pages
    got.append(ledger.outstanding())
    ledger.unmap(va + G, G)
    got.append(ledger.outstanding())
    ledger.free(va, 2 * G)
    got.append(ledger.outstanding())
    res, mapping = {va: 2 * G}, {va + G: G}
    expected = [
        Outstanding(),
        Outstanding(res),
        Outstanding(res, 1),
        Outstanding(res, 1, mapping),
        Outstanding(res, 0, mapping),
        Outstanding(res),
        Outstanding(),
    ]
    assert got == expected, (
        f"Ledger.outstanding() through reserve/create/map/release/unmap/free: expected {expected}, got {got}"
    )
    assert [bool(o) for o in got] == [False] + [True] * 5 + [False], (
        f"bool(Ledger.outstanding()): expected empty only at both ends, got {[bool(o) for o in got]}"
    )


def test_count_counts_calls_of_an_op_from_an_index_on(world):
    led = world.ledger
    mark = len(led.calls)
    led.map(world.va + 2 * G, G, world.spare)
    led.map(world.va + 3 * G, G, world.spare, G)
    led.unmap(world.va + 2 * G, G)
    got = {op: (led.count(op), led.count(op, mark)) for op in ("map", "unmap", "reserve", "zero")}
    expected = {"map": (3, 2), "unmap": (1, 1), "reserve": (2, 0), "zero": (0, 0)}
    assert got == expected, f"Ledger.count(op) and count(op, since={mark}): expected {expected}, got {got}"


def test_every_call_is_recorded_with_its_arguments_in_order(ledger):
    mark = len(ledger.calls)
    va = ledger.reserve(4 * G, 2 * G)
    handle = ledger.create(2 * G)
    ledger.map(va + G, G, handle, G)
    ledger.set_access(va + G, G)
    ledger.zero(va + G, G)
    ledger.synchronize()
    ledger.unmap(va + G, G)
    ledger.release(handle)
    ledger.free(va, 4 * G)
    expected = [
        Call("reserve", (4 * G, 2 * G)),
        Call("create", (2 * G,)),
        Call("map", (va + G, G, G)),
        Call("set_access", (va + G, G)),
        Call("zero", (va + G, G)),
        Call("synchronize", ()),
        Call("unmap", (va + G, G)),
        Call("release", (id(handle),)),
        Call("free", (va, 4 * G)),
    ]
    got = ledger.calls[mark:]
    assert got == expected, f"Ledger.calls: expected {expected}, got {got}"


def test_map_passes_the_offset_to_the_inner_driver(ledger):
    # A two-granule handle mapped twice, granule 1 alone at its offset and the whole handle: what is written through
    # the first mapping shows in the second granule of the second.
    va = ledger.reserve(3 * G, G)
    handle = ledger.create(2 * G)
    ledger.map(va, G, handle, G)
    ledger.map(va + G, 2 * G, handle, 0)
    ledger.set_access(va, 3 * G)
    ledger.inner.tensor(va, G, None).fill_(7)
    whole = ledger.inner.tensor(va + G, 2 * G, None)
    got = (int((whole[:G] == 7).sum()), int((whole[G:] == 7).sum()))
    assert got == (0, G), (
        f"Ledger.map(offset={G}): expected granule 1 of the handle written ({(0, G)} as "
        f"(7s in granule 0, 7s in granule 1)), got {got}"
    )
    del whole
    ledger.unmap(va, G)
    ledger.unmap(va + G, 2 * G)
    ledger.release(handle)
    ledger.free(va, 3 * G)


def test_outstanding_is_true_while_anything_is_held():
    cases = {
        "nothing": (Outstanding(), False),
        "a reservation": (Outstanding({1 << 20: G}), True),
        "a handle": (Outstanding({}, 1), True),
        "a mapping": (Outstanding({}, 0, {1 << 20: G}), True),
    }
    got = {name: bool(o) for name, (o, _) in cases.items()}
    expected = {name: truth for name, (_, truth) in cases.items()}
    assert got == expected, f"bool(Outstanding): expected {expected}, got {got}"


class MisalignedHost(RecordingHost):
    """Returns its reservation one granule past the alignment asked for."""

    def reserve(self, size, alignment):
        self.va = HostDriver.reserve(self, size + alignment, alignment)
        return self.va + G


def test_a_reservation_off_its_alignment_is_a_protocol_violation_naming_both():
    inner = MisalignedHost()
    with pytest.raises(ProtocolViolation) as info:
        Ledger(inner).reserve(2 * G, 2 * G)
    expected = f"recording-host: reserve returned {inner.va + G:#x}, not aligned to {2 * G}"
    inner.free(inner.va, 4 * G)
    assert str(info.value) == expected, f"Ledger.reserve: expected {expected!r}, got {str(info.value)!r}"


def test_free_does_not_count_a_mapping_that_starts_where_the_reservation_ends(ledger):
    va = ledger.reserve(2 * G, G)
    ledger.mappings[va + 2 * G] = G  # a neighbour's mapping, right after this reservation (on the books only)
    try:
        ledger.free(va, 2 * G)
    finally:
        del ledger.mappings[va + 2 * G]
    assert va not in ledger.reservations, f"Ledger.free: {va:#x} still reserved"


def test_an_injected_failure_names_the_driver_and_the_call_and_the_ledger_keeps_the_handle_cap(ledger):
    va = ledger.reserve(G, G)
    ledger.fail("zero")
    with pytest.raises(DriverError) as info:
        ledger.zero(va, G)
    got = (info.value.operation, info.value.detail)
    assert got == ("zero", f"injected failure (recording-host, args ({va}, {G}))"), f"injected failure: got {got}"
    ledger.free(va, G)
    capped = RecordingHost()
    capped.max_handle_bytes = 8 * G
    assert Ledger(capped).max_handle_bytes == 8 * G, "Ledger.max_handle_bytes: expected the inner driver's cap"
