"""The rules' assertion helpers: ``expect_equal`` compares the two values it prints, ``expect`` checks a condition
and prints the statement of it it was given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conformance.helpers import expect, expect_equal

DRIVER = SimpleNamespace(name="fake")


@pytest.mark.parametrize(
    "expected, actual", [(3, 3), ([True, False], [True, False]), ({1: 2}, {1: 2}), ((hex(4096), 8), (hex(4096), 8))]
)
def test_expect_equal_passes_equal_values(expected, actual):
    expect_equal(DRIVER, "op", expected, actual)


def test_expect_equal_fails_naming_the_driver_the_operation_and_the_values_it_compared():
    with pytest.raises(AssertionError) as info:
        expect_equal(DRIVER, "accessible granules after growth", [True, True, False], [True, False, False], segment=1)
    assert str(info.value) == (
        "driver fake: accessible granules after growth: expected [True, True, False], got "
        "[True, False, False], segment=1"
    )


def test_expect_equal_refuses_tensors():
    with pytest.raises(TypeError, match="expect_bytes"):
        expect_equal(DRIVER, "bytes", torch.zeros(2), torch.zeros(2))


def test_expect_checks_its_condition_and_prints_its_statement():
    expect(4096 % 4096 == 0, DRIVER, "granularity", "a positive multiple of 4096", 4096)
    with pytest.raises(AssertionError, match="driver fake: granularity: expected a positive multiple of 4096, got 100"):
        expect(100 % 4096 == 0, DRIVER, "granularity", "a positive multiple of 4096", 100)
