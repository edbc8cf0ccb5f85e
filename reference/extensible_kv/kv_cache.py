"""ExtensibleKVCacheBuffers: every KV cache buffer of a model as an ExtensibleTensor, grown a block prefix at a time.

One buffer per KV cache tensor (a buffer may be shared by several layers, as vLLM's ``KVCacheTensor.shared_by``),
each sized for the upper-bound block count and split into the lockstep segments its layers' layout needs
(``extensible_kv.layout``). ``ensure_blocks(n)`` commits blocks ``[0, n)`` in every segment of every buffer, as one
step: if any buffer fails, the buffers grown in that step are retracted and the old block count kept.

Per-layer views come in two kinds: ``layer_views`` at the full upper-bound shape, whose addresses never change
(what captured CUDA graphs and vLLM's forward context hold), and ``committed_layer_views`` over exactly the
committed blocks. Legacy mode commits everything at construction: the path when the feature is off.
After ``close()`` every method but ``close`` raises ``ClosedError``; the buffers cannot be copied or pickled.

States (``state``): ``open``; ``failed`` when a ``close()`` did not finish or a buffer is ``failed`` (a rollback of
growth could not unmap what the step made; ``ExtensibleTensor``'s module docstring): views and growth are refused
with ``FailedStateError``, no block counts as committed, and ``close()`` retried returns everything; ``released``
after ``release_physical()`` (sleep mode: every buffer's pages released, reservations and the block count kept; views
and growth refused with ``ReleasedError`` until ``recommit_physical()``, which maps zeroed pages back at the same
addresses in every buffer as one step: on any exception the buffers recommitted in it are released again);
``closed``. ``shrink_blocks(n)`` gives the blocks above ``n`` back in every buffer as one step (Note [A shrink of the
KV buffers is one step]).
A growth step is interrupt-safe as each buffer's is: the block count is set inside the step's ``try`` and every
buffer grown in it is retracted on any exception before it returns.

Note [A registration pins the committed blocks]
    A KV connector registers the committed blocks once (vLLM's connectors keep the first extent they are given, or
    register the memory with a transport), so once one has (``pin``) the buffers neither release their pages nor
    grow past the count it saw, on every path: ``release_physical`` here or on any buffer's tensor (sleep mode,
    a direct call) and ``ensure_blocks`` past the count (the commit RPC, a warmup, a direct call) are refused with
    ``BusyError`` naming the holder, before anything changes. Checking in the buffers, not in each caller, is what
    makes it every path: the sleep backend once released pages a connector held because only the commit RPC asked.

        pin("KV connector X") at 40 blocks -> ensure_blocks(40): 40 | ensure_blocks(41): BusyError
                                           -> release_physical(): BusyError, nothing released

Note [A buffer changed underneath]
    Rule: buffers whose tensor was resized, shrunk or unpinned directly through ``tensor(name)`` (its committed size
    is not the block count on record, or a holder of ``pin`` no longer pins it) are ``failed``, as for a tensor
    closed through it: every call but ``close()`` is refused with ``FailedStateError`` naming the buffer.
    Why: the buffers trust their record: ``ensure_blocks`` of the recorded count did nothing and
    ``committed_layer_views`` handed out views of pages a direct ``shrink_per_segment_(0)`` had unmapped (a write
    through one ended the process with SIGSEGV).
    Figure: the lifecycle model's ``change_kv_underneath`` (grown, shrunk or unpinned through ``tensor(name)``:
    failed, growth and views refused naming the buffer; undone, open at the count on record).

Note [A shrink of the KV buffers is one step]
    ``shrink_blocks(n)`` shrinks every buffer to ``n`` blocks or none: each buffer's shrink is all-or-nothing
    (Note [A shrink unmaps whole mappings] in ``tensor``), and when one fails (a driver error, an interrupt) the
    buffers already shrunk in the step are grown back to the old count, zeroed above ``n`` (their released bytes
    are gone), as ``ensure_blocks`` retracts a failed growth. A buffer that cannot grow back, or one left
    ``failed`` by its own shrink, leaves the buffers ``failed``: ``close()`` returns everything. A pin refuses a
    shrink below the count it saw (its views reach those blocks), before anything changes.

        [A 40 | B 40] shrink_blocks(8): A -> 8, B fails -> A grown back to 40 (blocks 8..39 zeroed), B at 40

Forks and finalizers, as for the tensor (Notes [Forked children] and [Operations never wait on themselves] in
``tensor``): in a forked child every call but ``close()`` is refused with the driver's ``DriverError``
(``records.check_process``) before any lock, and ``close()`` returns at once, giving nothing back (the parent owns
the memory); an operation that takes the buffers' lock, entered again by the thread already inside one, or calling
the driver from inside a driver call of this thread (a finalizer or a signal handler), is refused with
``BusyError`` and changes nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch

from .boundaries import shown
from .drivers import Driver, resolve
from .drivers.records import MAX_BYTES, check_process
from .errors import BusyError, ClosedError, FailedStateError, InvalidArgumentError, InvalidSizeError, ReleasedError
from .layout import Layer, LayoutError, Segments, buffer_segments
from .tensor import ExtensibleTensor, TensorStats, Unshareable, _check_int, reading_lock, refuse_reentry

T = TypeVar("T")
HOLDER_CHARS = 200
"""The longest name a ``pin`` holder may have: it is named in every refusal the pin causes, on one line."""


@dataclass(frozen=True)
class KVBuffer:
    """One KV cache buffer: ``page_size_bytes`` per block, viewed by ``layers``.

    The segment count is derived from the layers' layouts; a caller that derived it elsewhere (from the views a
    model runner builds, say) passes ``num_segments`` and no layers instead.
    """

    name: str
    page_size_bytes: int
    layers: tuple[Layer, ...] = ()
    num_segments: int | None = None

    def segments(self, max_num_blocks: int) -> Segments:
        if self.num_segments is not None:
            if self.layers:
                raise LayoutError(f"buffer {self.name}: give layers or num_segments, not both")
            n = _check_int(f"num_segments of buffer {self.name}", self.num_segments)
            if n <= 0:
                raise InvalidSizeError(f"buffer {self.name}: num_segments must be positive, got {n}")
            return Segments(n, self.page_size_bytes * max_num_blocks // n)
        return buffer_segments(self.layers, self.page_size_bytes, max_num_blocks)


@dataclass(frozen=True)
class BufferStats:
    name: str
    layers: tuple[str, ...]
    num_segments: int
    page_size_bytes: int
    reserved_bytes: int
    committed_bytes: int
    backed_bytes: int
    waste_bytes: int


@dataclass(frozen=True)
class KVCacheStats:
    """Plain accounting of a whole KV cache, in bytes and blocks, for reports (``to_dict`` is JSON-ready)."""

    driver: str
    granularity: int
    max_num_blocks: int
    num_blocks: int
    reserved_bytes: int
    committed_bytes: int
    backed_bytes: int
    waste_bytes: int
    buffers: tuple[BufferStats, ...]
    state: str = "open"

    def to_dict(self) -> dict:
        return asdict(self)


class ExtensibleKVCacheBuffers(Unshareable):
    """The KV cache buffers of a model (see the module docstring)."""

    def __init__(
        self,
        buffers: Sequence[KVBuffer],
        max_num_blocks: int,
        *,
        driver: Driver | str | None = None,
        legacy: bool = False,
    ) -> None:
        max_num_blocks = _check_int("max_num_blocks", max_num_blocks)
        if max_num_blocks <= 0:
            raise InvalidSizeError(f"max_num_blocks must be positive, got {max_num_blocks}")
        if isinstance(buffers, (str, bytes, KVBuffer)) or not hasattr(buffers, "__iter__"):
            raise InvalidArgumentError(
                f"ExtensibleKVCacheBuffers takes a sequence of KVBuffer objects, got {type(buffers).__name__}"
            )
        buffers = tuple(buffers)  # a generator is read once, here: every check below sees the same buffers
        if not buffers:
            raise InvalidSizeError("ExtensibleKVCacheBuffers needs at least one buffer")
        strays = [b for b in buffers if not isinstance(b, KVBuffer)]
        if strays:
            raise InvalidArgumentError(
                f"ExtensibleKVCacheBuffers takes KVBuffer objects, got {type(strays[0]).__name__} {strays[0]!r}"
            )
        unnamed = [b.name for b in buffers if not (isinstance(b.name, str) and b.name and b.name.isprintable())]
        if unnamed:
            raise InvalidArgumentError(
                f"a KV buffer's name must be non-empty printable text, got {type(unnamed[0]).__name__} "
                f"{shown(unnamed[0])}"
            )
        names = [b.name for b in buffers]
        layer_names = [layer.name for b in buffers for layer in b.layers]
        for kind, seq in (("buffer", names), ("layer", layer_names)):
            dups = sorted({n for n in seq if seq.count(n) > 1})
            if dups:
                raise InvalidSizeError(f"duplicate {kind} names: {dups}")
        for b in buffers:
            _check_int(f"page_size_bytes of buffer {b.name}", b.page_size_bytes)
            if b.page_size_bytes <= 0:
                raise InvalidSizeError(f"buffer {b.name}: page_size_bytes must be positive, got {b.page_size_bytes}")
            if b.page_size_bytes * max_num_blocks >= MAX_BYTES:
                raise InvalidSizeError(
                    f"buffer {b.name}: max_num_blocks={max_num_blocks} pages of "
                    f"{b.page_size_bytes} bytes do not fit a 64-bit address space (at most "
                    f"{MAX_BYTES - 1} bytes)"
                )
        segments = [b.segments(max_num_blocks) for b in buffers]
        for b, seg in zip(buffers, segments):
            if b.page_size_bytes % seg.count:
                raise LayoutError(
                    f"buffer {b.name}: {seg.count} segments do not divide its {b.page_size_bytes}-byte page"
                )
        driver = resolve(driver)
        self._driver = driver
        self._buffers = tuple(buffers)
        self._max_num_blocks = max_num_blocks
        self._num_blocks = 0
        self._closed = False
        self._mixed = ""  # why the buffers' block counts disagree (Note [A shrink of the KV buffers is one step])
        self._pid = os.getpid()
        self._in_step = threading.Lock()  # held while a step changes the buffers one by one (``_step``)
        self._lock = threading.RLock()  # reentry is refused, not waited on: Note [Operations never wait on themselves]
        self._pins: dict[str, int] = {}  # holder -> the block count it registered
        self._tensors: dict[str, ExtensibleTensor] = {}
        try:
            for b, seg in zip(buffers, segments):
                self._tensors[b.name] = ExtensibleTensor(
                    b.page_size_bytes * max_num_blocks,
                    seg.count,
                    driver=driver,
                    alignment=b.page_size_bytes // seg.count,
                )
        except BaseException:
            self.close()
            raise
        self._views: dict[str, list[tuple[torch.Tensor, int]]] = {}
        for b in buffers:
            raw = self._tensors[b.name].full_view(torch.int8)
            for layer in b.layers:
                self._views[layer.name] = list(zip(layer.views(raw, max_num_blocks), layer.block_dims()))
        if legacy:
            self.ensure_blocks(max_num_blocks)

    # -- properties --------------------------------------------------------------------------------------------
    @property
    def max_num_blocks(self) -> int:
        return self._max_num_blocks

    @property
    def num_blocks(self) -> int:
        """Blocks committed in every segment of every buffer; 0 unless open. Released, the count on record that
        ``recommit_physical`` maps back."""
        return self._num_blocks if self.state in ("open", "released") else 0

    @property
    def buffers(self) -> tuple[KVBuffer, ...]:
        return self._buffers

    @property
    def state(self) -> str:
        """``open``, ``released`` (every buffer released), ``failed`` (a close did not finish, a buffer is failed or
        was closed directly through ``tensor(name)``, or buffers are part released, part open: retry ``close()``) or
        ``closed``. Read from another thread it waits for a step in progress and names its result (Note [A reading
        waits for a step in another thread] in ``tensor``: a release is part released, part open until its last
        buffer)."""
        with reading_lock(self._lock, self._pid): return self._state_now()  # one line: see reaper  # fmt: skip

    def _state_now(self) -> str:
        tensors = self._tensors.values()
        if self._closed:
            return "closed" if all(t.closed for t in tensors) else "failed"
        states = {t.state for t in tensors}
        if (
            self._mixed
            or "failed" in states
            or "closed" in states
            or states >= {"open", "released"}
            or (not self._in_step.locked() and self._changed())
        ):  # part released, part open, or a buffer closed, resized or unpinned underneath: nothing to resume
            return "failed"
        return "released" if "released" in states else "open"

    def _step(self, op: str, body: Callable[..., T], *args: Any) -> T:
        """``body(*args)`` as one step, under the lock: first refused if a buffer was changed underneath; then,
        until it ends, ``state`` reads the record without comparing it to the buffers, which the step changes one by
        one (a reader in another thread or a signal handler sees no half-made step as a change)."""
        if self._changed():
            self._check_open(op)  # failed: refused naming the buffers
        with self._in_step: return body(*args)  # one line: no line event after the body returns  # fmt: skip

    def _changed(self) -> list[str]:
        """The buffers changed directly through ``tensor(name)``: resized or shrunk away from the block count on
        record, or no longer pinned by a holder of ``pin`` (Note [A buffer changed underneath])."""
        changed = []
        for b in self._buffers:
            t = self._tensors.get(b.name)
            if t is None:  # a construction that did not finish: its close() returns what it made
                continue
            size = self._num_blocks * (b.page_size_bytes // t.num_segments)
            if t.bytes_per_segment != size or any(holder not in t.pinned_by for holder in self._pins):
                changed.append(b.name)
        return changed

    @property
    def closed(self) -> bool:
        return self.state == "closed"

    def raw(self, buffer: str) -> torch.Tensor:
        """The whole buffer as a 1-D int8 tensor at its upper-bound size (what vLLM's runners reshape); a view, so
        refused with ``FailedStateError`` while the buffers are ``failed``."""
        if self.state == "failed":
            self._check_open("raw")
        return self.tensor(buffer).full_view(torch.int8)

    def tensor(self, buffer: str) -> ExtensibleTensor:
        self._check_open("tensor", failed_too=False)
        if not isinstance(buffer, str):
            raise InvalidArgumentError(f"a buffer is named by a str, got {type(buffer).__name__} {buffer!r}")
        if buffer not in self._tensors:
            raise InvalidSizeError(f"unknown buffer {buffer!r}; buffers: {sorted(self._tensors)}")
        return self._tensors[buffer]

    # -- growth ------------------------------------------------------------------------------------------------
    def ensure_blocks(self, num_blocks: int, zero_new: bool = True) -> int:
        """Commit blocks ``[0, num_blocks)`` in every segment of every buffer; return the committed block count.

        Idempotent and grow-only: a count at or below the committed one does nothing (so on legacy buffers, committed
        whole at construction, every count up to ``max_num_blocks`` is a no-op returning it). All buffers grow as one
        step:
        on any exception (a failed commit, a closed buffer, KeyboardInterrupt) the buffers grown in it are retracted.
        """
        num_blocks = _check_int("num_blocks", num_blocks)
        if num_blocks < 0:
            raise InvalidSizeError(f"num_blocks must be non-negative, got {num_blocks}")
        if num_blocks > self._max_num_blocks:
            raise InvalidSizeError(
                f"num_blocks={num_blocks} exceeds the reserved upper bound max_num_blocks={self._max_num_blocks}"
            )
        step, op = self._step, "ensure_blocks"
        with self._locked(op): return step(op, self._ensure, num_blocks, zero_new)  # one line: see reaper  # fmt: skip

    def _ensure(self, num_blocks: int, zero_new: bool) -> int:
        self._check_open("ensure_blocks")
        old = self._num_blocks
        if num_blocks <= old:
            return old
        if self._pins:
            raise BusyError(
                f"ensure_blocks({num_blocks}) on KV buffers at {old} blocks is refused: {', '.join(self._pins)} "
                f"registered the {old} committed blocks once (Note [A registration pins the committed blocks])"
            )
        marks = []
        try:
            for b in self._buffers:
                t = self._tensors[b.name]
                marks.append((t, t.checkpoint()))
                t.resize_per_segment_(num_blocks * (b.page_size_bytes // t.num_segments), zero_new=zero_new)
            self._num_blocks = num_blocks
            return num_blocks
        except BaseException:
            self._num_blocks = old
            for t, mark in reversed(marks):  # the failed tensor rolled itself back: retracting it is a no-op
                t.rollback_to(mark)  # what it could not undo leaves it (and so these buffers) failed
            raise

    # -- shrink ------------------------------------------------------------------------------------------------
    def shrink_blocks(self, num_blocks: int) -> int:
        """Shrink every segment of every buffer to blocks ``[0, num_blocks)`` as one step and give the granules above
        back; return the bytes released (backed bytes before minus after, over every buffer). Blocks below
        ``num_blocks`` keep their bytes and every address stays; ``ensure_blocks`` grows back (zeroed). ``0`` releases
        everything and stays open; the committed count is a no-op returning 0. Refused, nothing changed:
        ``InvalidSizeError`` (not an int, negative, above the committed count), ``ReleasedError`` while released,
        ``BusyError`` while a ``pin`` saw blocks at or above ``num_blocks`` (Note [A shrink of the KV buffers is one
        step]).
        """
        num_blocks = _check_int("num_blocks", num_blocks)
        if num_blocks < 0:
            raise InvalidSizeError(f"shrink_blocks needs a non-negative block count, got num_blocks={num_blocks}")
        with self._locked("shrink_blocks"): return self._step("shrink_blocks", self._shrink, num_blocks)  # fmt: skip

    def _shrink(self, num_blocks: int) -> int:
        self._check_open("shrink_blocks")
        old = self._num_blocks
        if num_blocks > old:
            raise InvalidSizeError(
                f"shrink_blocks({num_blocks}) on KV buffers at {old} blocks: a shrink cannot grow (use ensure_blocks)"
            )
        held = [f"{holder} (at {n} blocks)" for holder, n in self._pins.items() if n > num_blocks]
        if held:
            raise BusyError(
                f"shrink_blocks({num_blocks}) on KV buffers at {old} blocks is refused: {', '.join(held)} registered "
                f"views of the blocks it would release; nothing was released (Note [A registration pins the "
                f"committed blocks])"
            )
        if num_blocks == old:
            return 0
        for b in self._buffers:  # every buffer's refusals first: one refused after another shrank would zero its data
            t = self._tensors[b.name]
            t.check_shrink(num_blocks * (b.page_size_bytes // t.num_segments))
        before = sum(t.stats().backed_bytes for t in self._tensors.values())
        try:
            for b in self._buffers:
                t = self._tensors[b.name]
                t.shrink_per_segment_(num_blocks * (b.page_size_bytes // t.num_segments))
            self._num_blocks = num_blocks
        except BaseException:
            self._num_blocks = old
            for b in reversed(self._buffers):  # by size, not by the loop: an interrupt may land after one's return
                t = self._tensors[b.name]
                if t.state == "open" and t.bytes_per_segment < old * (b.page_size_bytes // t.num_segments):
                    self._regrow(b, t, old)
            raise
        return before - sum(t.stats().backed_bytes for t in self._tensors.values())

    def _regrow(self, b: KVBuffer, t: ExtensibleTensor, num_blocks: int) -> None:
        """Grow ``t`` back to ``num_blocks`` after a failed shrink step; one that cannot leaves the buffers
        ``failed`` (their block counts no longer agree)."""
        try:
            t.resize_per_segment_(num_blocks * (b.page_size_bytes // t.num_segments))
        except BaseException as exc:  # the step's own exception is the one raised; this one is named in the state
            self._mixed = (
                f"buffer {b.name} could not grow back to {num_blocks} blocks after a failed shrink: "
                f"{type(exc).__name__}: {exc}"
            )

    # -- release and recommit (sleep mode) -----------------------------------------------------------------------
    def release_physical(self) -> None:
        """Release every buffer's pages, keeping the reservations and the block count (state ``released``). The
        views handed out keep their addresses and must not be touched until ``recommit_physical()``. Refused unless
        open (``ReleasedError`` when released already). A release that does not finish leaves the buffers
        ``failed``: ``close()`` returns the rest."""
        with self._locked("release_physical"): return self._step("release_physical", self._release)  # fmt: skip

    def _release(self) -> None:
        self._check_open("release_physical")
        held = sorted({holder for t in self._tensors.values() for holder in t.pinned_by})
        if held:
            raise BusyError(
                f"release_physical on KV buffers at {self._num_blocks} blocks is refused: {', '.join(held)} "
                f"registered views of them and would be left on unmapped memory; nothing was released (Note [A "
                f"registration pins the committed blocks])"
            )
        for t in self._tensors.values():
            if t.state == "open":  # a buffer released before an interrupt is not released twice
                t.release_physical()

    def recommit_physical(self) -> int:
        """Map zeroed pages back for the block count on record in every buffer, at the same addresses, as one step;
        return the block count. On any exception the buffers recommitted in the step are released again and the
        buffers stay ``released``. Refused unless released."""
        with self._locked("recommit_physical"): return self._step("recommit_physical", self._recommit)  # fmt: skip

    def _recommit(self) -> int:
        if self.state != "released":
            self._check_open("recommit_physical")
            raise ReleasedError(
                f"recommit_physical on ExtensibleKVCacheBuffers that are not released "
                f"({len(self._buffers)} buffer(s), {self._num_blocks} blocks committed): call "
                f"release_physical() first"
            )
        try:
            for t in self._tensors.values():
                t.recommit_physical()
            return self._num_blocks
        except BaseException:
            for t in self._tensors.values():  # every buffer the step left open, the one it stopped in included
                if t.state == "open":
                    t.release_physical()
            raise

    @property
    def released(self) -> bool:
        return self.state == "released"

    # -- registrations (Note [A registration pins the committed blocks]) ---------------------------------------------
    def pin(self, holder: str) -> None:
        """Record that ``holder`` registered the committed blocks: release and growth are refused until ``unpin``."""
        if not isinstance(holder, str) or not holder or not holder.isprintable() or len(holder) > HOLDER_CHARS:
            raise InvalidArgumentError(
                f"pin needs a holder's name of printable text, at most {HOLDER_CHARS} characters, got "
                f"{type(holder).__name__} {shown(holder)}"
            )
        with self._locked("pin", driver=False): return self._step("pin", self._pin, holder)  # fmt: skip

    def _pin(self, holder: str) -> None:
        self._check_open("pin")
        if holder in self._pins:
            raise InvalidArgumentError(f"pin({holder!r}): already pinned at {self._pins[holder]} blocks")
        before = [(t, t.pinned_by.count(holder)) for t in self._tensors.values()]
        try:
            for t in self._tensors.values():
                t.pin(holder)
            self._pins[holder] = self._num_blocks
        except BaseException:  # an interrupt between two buffers: no buffer keeps a pin the buffers do not record
            if holder not in self._pins:
                for t, count in reversed(before):
                    while t.pinned_by.count(holder) > count:
                        t.unpin(holder)
            raise

    def unpin(self, holder: str) -> None:
        """Drop ``holder``'s registration (``pin``)."""
        with self._locked("unpin", driver=False): return self._step("unpin", self._unpin, holder)  # fmt: skip

    def _unpin(self, holder: str) -> None:
        if not isinstance(holder, str) or holder not in self._pins:
            raise InvalidArgumentError(f"unpin({holder!r:.80}): not pinned by it; pinned by {sorted(self._pins)}")
        before = [(t, t.pinned_by.count(holder)) for t in self._tensors.values()]
        try:
            for t in self._tensors.values():
                if holder in t.pinned_by:
                    t.unpin(holder)
            del self._pins[holder]
        except BaseException:  # an interrupt between two buffers: every buffer keeps the pin the buffers record
            if holder in self._pins:
                for t, count in reversed(before):
                    while t.pinned_by.count(holder) < count:
                        t.pin(holder)
            raise

    @property
    def pinned_by(self) -> dict[str, int]:
        """Who registered the committed blocks (``pin``), with the block count each saw."""
        return dict(self._pins)

    # -- views -------------------------------------------------------------------------------------------------
    def layer_views(self, layer: str) -> list[torch.Tensor]:
        """The layer's views at the full upper-bound shape (one per Mamba state, one for attention).

        Addresses never change; only blocks below ``num_blocks`` may be touched.
        """
        return [v for v, _ in self._layer(layer)]

    def committed_layer_views(self, layer: str) -> list[torch.Tensor]:
        """The layer's views narrowed to exactly the committed blocks. While one lives, a ``shrink_blocks`` below
        them is refused (``BusyError``), as for a segment view: they never sit over released pages."""
        with self._locked("layer views", driver=False):
            self._layer(layer)  # refusals: closed, failed, released, not a layer name
            buffer, spec = next((b, x) for b in self._buffers for x in b.layers if x.name == layer)
            raw = self._tensors[buffer.name].full_view(torch.int8, keep_committed=True)
            views = spec.views(raw, self._max_num_blocks)
            return [v.narrow(d, 0, self._num_blocks) for v, d in zip(views, spec.block_dims(), strict=True)]

    def _layer(self, layer: str) -> list[tuple[torch.Tensor, int]]:
        self._check_open("layer views")
        if not isinstance(layer, str):
            raise InvalidArgumentError(f"a layer is named by a str, got {type(layer).__name__} {layer!r}")
        if layer not in self._views:
            raise InvalidSizeError(f"unknown layer {layer!r}; layers: {sorted(self._views)[:8]}")
        return self._views[layer]

    # -- accounting and lifetime -------------------------------------------------------------------------------
    def stats(self) -> KVCacheStats:
        """The accounting; in the ``failed`` state it says so and counts no block as committed (a buffer already
        closed counts nothing)."""
        self._check_open("stats", failed_too=False)
        rows = []
        for b in self._buffers:
            t = self._tensors[b.name]
            s = (
                t.stats()
                if not t.closed
                else TensorStats(0, 0, 0, 0, t.segment_bytes, t.num_segments, t.granularity, 0, "closed")
            )
            rows.append(
                BufferStats(
                    b.name,
                    tuple(layer.name for layer in b.layers),
                    s.num_segments,
                    b.page_size_bytes,
                    s.reserved_bytes,
                    s.committed_bytes,
                    s.backed_bytes,
                    s.waste_bytes,
                )
            )
        return KVCacheStats(
            driver=self._driver.name,
            granularity=self._driver.granularity(),
            max_num_blocks=self._max_num_blocks,
            num_blocks=self.num_blocks,
            reserved_bytes=sum(r.reserved_bytes for r in rows),
            committed_bytes=sum(r.committed_bytes for r in rows),
            backed_bytes=sum(r.backed_bytes for r in rows),
            waste_bytes=sum(r.waste_bytes for r in rows),
            buffers=tuple(rows),
            state=self.state,
        )

    def close(self) -> None:
        """Drop the views this object holds and close every buffer (forcing: callers promise not to use views). A
        buffer whose close fails is tried again by the next ``close()``; the others are closed meanwhile, and the
        first failure is raised. In a forked child it returns at once, giving nothing back (the module docstring)."""
        if self._pid != os.getpid():  # no lock: each tensor's close() returns at once in a child
            return self._close()
        with self._locked("close"): return self._close()  # one line: see reaper  # fmt: skip

    def _close(self) -> None:
        self._closed = True
        self._views = {}
        failures = []
        for t in self._tensors.values():
            try:
                t.close(force=True)
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    def _locked(self, op: str, driver: bool = True) -> threading.RLock:
        """The buffers' lock for ``op``, refusing first what would wait forever: a forked child (``DriverError``), an
        operation of these buffers running in this thread, or, for one that calls the driver, a driver call of this
        thread in progress (``BusyError``); the module docstring."""
        check_process(op, self._driver.name, self._pid)
        refuse_reentry(op, self, "KV cache", self._lock, driver)
        return self._lock

    def __repr__(self) -> str:
        return (
            f"ExtensibleKVCacheBuffers({len(self._buffers)} buffer(s), {self._num_blocks} of {self._max_num_blocks} "
            f"blocks, driver {self._driver.name})"
        )

    def _check_open(self, op: str, *, failed_too: bool = True) -> None:
        check_process(op, self._driver.name, self._pid)  # the calls that take no lock: a child is refused here
        state = self.state
        if state == "closed":
            raise ClosedError(
                f"{op} on closed ExtensibleKVCacheBuffers ({len(self._buffers)} buffer(s), "
                f"max_num_blocks={self._max_num_blocks})"
            )
        if state == "released" and failed_too:  # queries (stats, tensor) still answer
            raise ReleasedError(
                f"{op} on released ExtensibleKVCacheBuffers ({len(self._buffers)} buffer(s), "
                f"{self._num_blocks} blocks on record): their pages were released by "
                f"release_physical(); call recommit_physical() first"
            )
        if state == "failed" and failed_too:
            states = {name: t.state for name, t in self._tensors.items()}
            failed = [f"{name} ({t._failure})" for name, t in self._tensors.items() if states[name] == "failed"]
            closed = [name for name, state in states.items() if state == "closed"]
            released = [name for name, state in states.items() if state == "released"]
            what = (
                "close() did not finish"
                if self._closed
                else self._mixed
                or (f"buffer(s) {', '.join(failed)}" if failed else "")
                or (f"buffer(s) {closed} were closed directly, through tensor(name)" if closed else "")
                or (
                    f"a release or a recommit did not finish: buffer(s) {released} released, the others open"
                    if released and len(released) < len(states)
                    else ""
                )
                or f"buffer(s) {self._changed()} were resized or unpinned directly, through tensor(name)"
            )
            raise FailedStateError(
                f"{op} on failed ExtensibleKVCacheBuffers ({len(self._buffers)} buffer(s), "
                f"max_num_blocks={self._max_num_blocks}): {what}; retry close() to return the "
                f"memory they hold"
            )
