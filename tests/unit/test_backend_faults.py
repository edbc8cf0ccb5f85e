"""``validate_backend`` never raises for a backend's fault: a shape function that fails at any of its calls (the
layout, the views of construction, the views of the checks), by an exception or ``sys.exit``, is a failed report,
and the memory of the check is returned."""

from __future__ import annotations

import pytest

from extensible_kv.backend_check import validate_backend
from extensible_kv.drivers.host import HostDriver


def _failing_at(n: int, fault: BaseException) -> type:
    calls = [0]

    class Backend:
        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
            calls[0] += 1
            if calls[0] == n:
                raise fault
            return (num_blocks, 2, block_size, num_kv_heads, head_size)

    Backend.calls = calls
    return Backend


def _calls_of_a_whole_check() -> int:
    backend = _failing_at(0, RuntimeError())
    assert validate_backend(backend, driver=HostDriver(granularity=4096, name="unit-host")).ok
    return backend.calls[0]


@pytest.mark.parametrize("fault", [RuntimeError("changed"), SystemExit(0), GeneratorExit()], ids=repr)
def test_a_backend_that_fails_at_any_call_is_a_failed_report_and_holds_nothing(fault):
    # wrong: only the layout's call guarded (a later call's exception ended validate-backend, sys.exit(0) with
    # status 0 and nothing reported), or a failed check that leaves the reservation behind
    total = _calls_of_a_whole_check()
    assert total > 2, f"expected the checks to ask the backend for its shape more than twice, got {total}"
    for n in range(1, total + 1):
        driver = HostDriver(granularity=4096, name="unit-host")
        report = validate_backend(_failing_at(n, fault), driver=driver)
        failed = [c.name for c in report.checks if not c.ok]
        held = driver.mem_info()[1] - driver.mem_info()[0]
        assert not report.ok and failed and held == 0, (
            f"unit-host: {fault!r} at shape call {n} of {total}: expected a failed report and nothing held, got "
            f"ok={report.ok}, failed checks {failed}, {held} bytes held"
        )
