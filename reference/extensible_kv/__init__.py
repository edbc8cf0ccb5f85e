"""extensible_kv: growable, virtual-memory-backed tensors and KV caches with stable base addresses."""

from .drivers import Driver, Ledger, best_available, get_driver, probe, register, registered
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
from .tensor import ExtensibleTensor, TensorStats

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
