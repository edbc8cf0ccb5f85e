"""Driver factories for the unit tests, loaded by ``module:factory`` spec (``tests.unit._factories:...``)."""

from __future__ import annotations

from extensible_kv.drivers.host import HostDriver

NOT_CALLABLE = 42  # a spec naming this must be refused: it is not a factory


def host_4k() -> HostDriver:
    """An intact 4 KiB host driver."""
    return HostDriver(granularity=4096, name="unit-host-4k")


class _NoZero(HostDriver):
    """zero() does nothing, so fresh pages keep the host driver's 0xA5 fill."""

    def zero(self, va: int, size: int) -> None:
        pass


def no_zero() -> HostDriver:
    """A broken 4 KiB host driver whose zero() is a no-op."""
    return _NoZero(granularity=4096, name="unit-no-zero")


class _EndsRules(HostDriver):
    """reserve() raises one of pytest's outcomes (``outcome``: skip, xfail or exit)."""

    outcome = "skip"

    def reserve(self, size: int, alignment: int = 0) -> int:
        import pytest

        if self.outcome == "exit":
            pytest.exit("a driver ends the run", returncode=0)
        getattr(pytest, self.outcome)("a driver decides")
        return 0


def skips() -> HostDriver:
    """A driver whose reserve() calls pytest.skip."""
    return _EndsRules(granularity=4096, name="unit-skips")


def xfails() -> HostDriver:
    """A driver whose reserve() calls pytest.xfail."""
    driver = _EndsRules(granularity=4096, name="unit-xfails")
    driver.outcome = "xfail"
    return driver


def exits() -> HostDriver:
    """A driver whose reserve() calls pytest.exit(returncode=0)."""
    driver = _EndsRules(granularity=4096, name="unit-exits")
    driver.outcome = "exit"
    return driver


class _Partial:
    """Has some of the protocol (granularity, reserve, name) but not the rest."""

    name = "partial"

    def granularity(self) -> int:
        return 4096

    def reserve(self, size: int, alignment: int) -> int:
        return 0


def partial() -> _Partial:
    return _Partial()


def bare() -> object:
    return object()


class KVFirstBackend:
    """An attention backend with a K/V-first layout ``(2, B, N, H, D)`` and no stride order (identity)."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (2, num_blocks, block_size, num_kv_heads, head_size)
