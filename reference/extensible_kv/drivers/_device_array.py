"""The smallest object ``torch.as_tensor`` accepts as device memory (``__cuda_array_interface__``, v3).

torch keeps the object alive for as long as the tensor's storage lives, so ``keeper`` (the owner of the memory)
stays alive with it and no deleter of ours ever runs. torch's ROCm build reads the same interface.

Public as ``extensible_kv.drivers.DeviceArray``: a GPU driver's ``tensor(va, nbytes, keeper)`` is
``torch.as_tensor(DeviceArray(va, nbytes, keeper), device=self.device)``, as the CUDA and HIP drivers' are.
"""

from __future__ import annotations


class DeviceArray:
    """``nbytes`` bytes of device memory at ``va`` as a 1-D uint8 array; holds ``keeper``."""

    __slots__ = ("__cuda_array_interface__", "keeper")

    def __init__(self, va: int, nbytes: int, keeper: object) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (va, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }
        self.keeper = keeper
