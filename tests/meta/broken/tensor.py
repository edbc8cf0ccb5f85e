"""Broken drivers of ``tensor``, ``device`` and ``synchronize`` (P-tensor, P-tensor-keeper, P-tensor-device,
P-synchronize).
"""

from __future__ import annotations

import ctypes

import torch

from extensible_kv.drivers import host
from tests.meta.broken.base import Broken


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
