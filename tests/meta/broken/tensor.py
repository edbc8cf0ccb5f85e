"""Broken drivers of ``tensor``, ``device`` and ``synchronize`` (P-tensor, P-tensor-keeper, P-tensor-device,
P-synchronize).
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time

import torch

from extensible_kv.drivers import host
from extensible_kv.reaper import busy
from tests.meta.broken.base import Broken, KeeperSlot


class MovingBase(Broken):
    """tensor() hands out fresh memory elsewhere, so addresses seen by callers move and writes go nowhere."""

    breaks = "P-tensor"
    caught_by = ("test_base_address_is_stable_across_growth", "test_tensor_aliases_memory_without_copy")

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class TensorCopiesLarge(Broken):
    """tensor() returns a copy of the bytes for views over 16 MiB."""

    breaks = "P-tensor"
    caught_by = ("test_tensor_of_64_mib_aliases_memory_without_copy",)

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        view = super().tensor(va, nbytes, keeper)
        return view.clone() if nbytes > 16 * host.MIB else view


class TensorDropsKeeper(Broken):
    """tensor() does not keep its keeper alive."""

    breaks = "P-tensor-keeper"
    caught_by = ("test_tensor_keeps_its_keeper_alive",)

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        return super().tensor(va, nbytes, None)


class DeviceIsAString(Broken):
    """Identity. Breaks "``device: torch.device`` ... whose tensors ``tensor`` returns": it names its device with the
    string ``"cpu"``, which no ``torch.device`` equals."""

    breaks = "P-tensor-device"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    device = "cpu"  # type: ignore[assignment]


class TensorKeeperOnTheTensor(Broken):
    """Tensors. Breaks "[P-tensor-keeper] Its storage holds a strong reference to ``keeper`` until the storage is
    freed": it holds the keeper on the tensor it returns, not on its storage, so the keeper goes with that tensor while
    a view keeps the storage (and the memory) in use."""

    breaks = "P-tensor-keeper"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        t = super().tensor(va, nbytes, None)
        t.keeper = keeper
        return t


class TensorRoundsDownAnOddBase(Broken):
    """P-tensor. Breaks "A 1-D ``torch.uint8`` tensor of ``nbytes`` elements over ``[va, va+nbytes)`` (``data_ptr()
    == va``) ... at any address": it builds its buffer from ``va`` rounded down to 8 bytes (for aligned loads) and
    forgets to skip the rounding, so a tensor at an address that is not a multiple of 8 starts up to 7 bytes early."""

    breaks = "P-tensor"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self.check_call("tensor", va=va, size=nbytes)
        base = va & ~7
        buffer = (ctypes.c_uint8 * (nbytes + va - base)).from_address(base)
        buffer.keeper = keeper
        return torch.frombuffer(buffer, dtype=torch.uint8)[:nbytes]


class SynchronizeWaitsForItsOwnThread(Broken):
    """P-synchronize. Breaks "Wait for the device's outstanding work": like a backend on per-thread streams, a ``zero``
    from a thread other than the one that built the driver is launched on that thread's stream (a worker that starts
    after a launch latency), and ``synchronize`` waits for the calling thread's stream only, so a ``zero`` made from
    another thread may still be pending when the building thread's ``synchronize`` returns. A thread that synchronizes
    its own work, and every ``zero`` from the building thread, see it done."""

    breaks = "P-synchronize"
    caught_by = (
        "test_calls_from_two_threads_match_some_serial_order",
        "test_every_call_from_a_thread_new_to_the_driver_is_taken",
        "test_every_contended_pair_of_calls_from_two_threads_matches_some_serial_order",
    )

    LAUNCH_S = 0.1

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._owner = threading.get_ident()
        self._streams: dict[int, list[threading.Thread]] = {}

    def zero(self, va: int, size: int) -> None:
        me = threading.get_ident()
        if me == self._owner:
            super().zero(va, size)
            return
        self.check_call("zero", va=va, size=size)
        with busy(), self.locked():
            stream = self._streams.setdefault(me, [])
            job = threading.Thread(target=self._launch, args=(stream[-1] if stream else None, va, size), daemon=True)
            stream.append(job)
        job.start()

    def _launch(self, before: threading.Thread | None, va: int, size: int) -> None:
        if before is not None:
            before.join()
        time.sleep(self.LAUNCH_S)
        g = self.granularity()
        with busy(), self.locked():  # never into memory unmapped meanwhile (that would crash the process)
            if all(host.HostDriver.accessible(self, a) for a in range(va - va % g, va + size, g)):
                ctypes.memset(va, 0, size)

    def synchronize(self) -> None:
        with busy(), self.locked():
            jobs = list(self._streams.get(threading.get_ident(), []))
        for job in jobs:
            job.join()


class SynchronizeWaitsForAnEmptyQueue(Broken):
    """P-synchronize. Breaks "Wait for the device's outstanding work and return ``None``": a zero of 16 MiB and more is
    queued to a worker (an asynchronous fill on a stream, after a launch latency), and ``synchronize`` waits until the
    queue is empty, not until its work is done: the worker takes a job off the queue before it runs it, so
    ``synchronize`` returns while the zero is still pending. Smaller zeroes are synchronous."""

    breaks = "P-synchronize"
    caught_by = ("test_zero_of_64_mib_sets_every_byte",)

    LARGE = 16 * host.MIB
    LAUNCH_S = 0.5

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._queue: queue.Queue[tuple[int, int]] = queue.Queue()

    def zero(self, va: int, size: int) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < self.LARGE:
            super().zero(va, size)
            return
        self.check_call("zero", va=va, size=size)
        self._queue.put((va, size))
        threading.Thread(target=self._launch, daemon=True).start()

    def _launch(self) -> None:
        va, size = self._queue.get()
        try:
            time.sleep(self.LAUNCH_S)
            g = self.granularity()
            with busy(), self.locked():  # never into memory unmapped meanwhile (that would crash the process)
                if all(host.HostDriver.accessible(self, a) for a in range(va - va % g, va + size, g)):
                    ctypes.memset(va, 0, size)
        finally:
            self._queue.task_done()

    def synchronize(self) -> None:
        while not self._queue.empty():
            time.sleep(1e-3)


class KeepersInATableOf100(Broken):
    """P-tensor-keeper. Breaks "Its storage holds a strong reference to ``keeper`` until the storage is freed": like a
    native context with a user-data array of 100 entries, the keepers live in a table of 100 slots handed out round
    robin, and the storage holds its slot (emptied when the storage is freed), on the belief that a slot is free again
    by the time the ring comes back to it: the 101st tensor made while the first still lives takes the first one's slot,
    and its keeper may be collected. With fewer than 100 tensors made over a live one, every keeper is held."""

    breaks = "P-tensor-keeper"
    caught_by = ("test_every_call_is_judged_as_the_model_says_at_every_count_of_live_objects",)

    SLOTS = 100

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._keepers: dict[int, tuple[int, object]] = {}
        self._serial = 0

    def _take_slot(self) -> int:
        serial, self._serial = self._serial, self._serial + 1
        return serial

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self.check_call("tensor", va=va, size=nbytes)
        buffer = (ctypes.c_uint8 * nbytes).from_address(va)
        with busy(), self.locked(): serial = self._take_slot()  # fmt: skip
        slot = serial % self.SLOTS
        self._keepers[slot] = (serial, keeper)
        buffer.keeper = KeeperSlot(self._keepers, slot, serial)
        return torch.frombuffer(buffer, dtype=torch.uint8)
