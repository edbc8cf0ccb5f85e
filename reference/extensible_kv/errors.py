"""The typed errors of extensible_kv.

Every error raised on purpose by this package derives from ``ExtensibleKVError``; the size and usage errors
also derive from the built-in class a caller would expect (``ValueError``, ``RuntimeError``, ``MemoryError``),
so ``except ValueError`` keeps working. Messages name the values involved.
"""

from __future__ import annotations


class ExtensibleKVError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidSizeError(ExtensibleKVError, ValueError):
    """A size, count or index is out of range, misaligned, or would shrink a grow-only object."""


class SegmentIndexError(InvalidSizeError, IndexError):
    """A segment index out of range: an ``InvalidSizeError`` and, as an index, an ``IndexError``."""


class InvalidArgumentError(ExtensibleKVError, TypeError):
    """An argument has the wrong type (a dtype that is not a ``torch.dtype``, say); the message names it."""


class ClosedError(ExtensibleKVError, RuntimeError):
    """The object was closed; its memory is gone and it can no longer be used."""


class BusyError(ExtensibleKVError, RuntimeError):
    """The object cannot be closed: views of its memory are still alive."""


class FailedStateError(ExtensibleKVError, RuntimeError):
    """The object is in its failed state: a ``close()`` or a growth step's rollback did not finish, so it may hold
    memory that is no longer mapped as its size says. It refuses views and growth; ``close()`` retried returns
    everything it still holds. The message names the operation refused and what did not finish."""


class ReleasedError(ExtensibleKVError, RuntimeError):
    """The object's pages are released (``release_physical``): its reservation and committed size are kept, but
    views and growth are refused until ``recommit_physical()`` maps zeroed pages back at the same addresses (and
    ``recommit_physical`` is refused on an object that is not released). The message names the operation refused."""


class DriverUnavailable(ExtensibleKVError, RuntimeError):
    """A driver cannot run here (no library, no device, no VMM support); the message says which."""


class DriverLoadError(ExtensibleKVError, ValueError):
    """A driver name or ``module:factory`` spec could not be resolved to a driver."""


class DriverError(ExtensibleKVError, RuntimeError):
    """A native VMM call failed.

    ``operation`` is the protocol operation (``reserve``, ``create``, ``map``, ...), ``detail`` the native call and
    its arguments, ``code`` the native error code where there is one.
    """

    def __init__(self, operation: str, detail: str, code: object = None) -> None:
        self.operation = operation
        self.detail = detail
        self.code = code
        suffix = f" (code {code})" if code is not None else ""
        super().__init__(f"{operation} failed: {detail}{suffix}")


class DriverOutOfMemory(DriverError, MemoryError):
    """The driver refused a reservation or a physical allocation for lack of memory."""


class ProtocolViolation(ExtensibleKVError, AssertionError):
    """A caller broke the driver protocol (overlapping map, partial unmap, freeing a mapped range, ...).

    Raised by ``extensible_kv.drivers.Ledger``, which checks every call against the protocol's rules.
    """


class CommitError(ExtensibleKVError, RuntimeError):
    """A growth step failed; everything it mapped was unmapped and released, and the old size was kept.

    ``operation`` names the driver operation that failed, ``requested`` and ``committed`` are bytes per segment.
    The driver's error is the ``__cause__``.
    """

    def __init__(self, message: str, *, operation: str, requested: int, committed: int) -> None:
        self.operation = operation
        self.requested = requested
        self.committed = committed
        super().__init__(message)


class ShrinkError(CommitError):
    """A shrink step (``shrink_per_segment_``) failed at a driver call. ``committed`` is the size per segment the
    tensor kept (the old one: nothing was unmapped) and ``requested`` the size asked; when the failure came after the
    step had started unmapping, the tensor is ``failed`` instead and ``close()`` returns everything (the message
    says which). The driver's error is the ``__cause__``."""


class CommitOutOfMemory(CommitError, MemoryError):
    """A growth step was refused by the driver for lack of memory (see ``CommitError``)."""
