"""extensible_kv: growable, virtual-memory-backed tensors and KV caches with stable base addresses.

The drivers and the tensor (and torch beneath them) load when first named, so that importing the package, as the
command line does before it can answer an interrupt in one line, runs nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import (
    BusyError,
    ClosedError,
    CommitError,
    CommitOutOfMemory,
    DriverError,
    DriverLoadError,
    DriverOutOfMemory,
    DriverUnavailable,
    ExtensibleKVError,
    FailedStateError,
    InvalidArgumentError,
    InvalidSizeError,
    ProtocolViolation,
    ReleasedError,
    ShrinkError,
)

if TYPE_CHECKING:
    from .drivers import Driver, Ledger, best_available, get_driver, probe, register, registered
    from .tensor import ExtensibleTensor, TensorStats

_LOADED_FROM = {
    **dict.fromkeys(("Driver", "Ledger", "best_available", "get_driver", "probe", "register", "registered"), "drivers"),
    **dict.fromkeys(("ExtensibleTensor", "TensorStats"), "tensor"),
}


def __getattr__(name: str) -> object:
    module = _LOADED_FROM.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "BusyError",
    "ClosedError",
    "CommitError",
    "CommitOutOfMemory",
    "Driver",
    "DriverError",
    "DriverLoadError",
    "DriverOutOfMemory",
    "DriverUnavailable",
    "ExtensibleKVError",
    "ExtensibleTensor",
    "FailedStateError",
    "InvalidArgumentError",
    "InvalidSizeError",
    "Ledger",
    "ProtocolViolation",
    "ReleasedError",
    "ShrinkError",
    "TensorStats",
    "best_available",
    "get_driver",
    "probe",
    "register",
    "registered",
]
