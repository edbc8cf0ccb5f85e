"""Every numeric option x every kind of number that is out of its range: refused with one line naming the option and
the value, exit status 2, before any work (Note [A number from outside is in range before it is used]).

``check-driver``'s options are checked by ``conformance.check_driver`` before it starts a child: a value it let through
would start the preflight and pytest, so each case also runs no rule (``-k`` selects none). The parsers themselves are
driven by Hypothesis over any text, float and integer: every value is either returned within its range or refused.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance import check_driver
from extensible_kv.__main__ import main
from extensible_kv.boundaries import numbers

GOOD_BACKEND = "tests.unit._factories:KVFirstBackend"
HUGE_INT = "9" * 5000  # past Python's 4,300-digit limit of int()

# option -> (how to run it with VALUE, whether 0 is in range)
OPTIONS = {
    "--build-timeout": ("check-driver", True),
    "--rule-timeout": ("check-driver", True),
    "--commit-probe-bytes": ("check-driver", False),
    "--num-kv-heads": ("validate-backend", False),
    "--head-size": ("validate-backend", False),
    "--block-size": ("validate-backend", False),
}
VALUES = {"nan": "nan", "inf": "inf", "-inf": "-inf", "1e308": "1e308", "-5": "-5", "0": "0", "huge_int": HUGE_INT}
VALUES |= {"text": "ten", "hex": "0x10", "empty": ""}


def _cases():
    for option, (command, zero_ok) in OPTIONS.items():
        for name, value in VALUES.items():
            if name == "0" and zero_ok:
                continue  # 0: no limit, a value in range
            yield pytest.param(command, option, value, id=f"{option}-{name}")


@pytest.mark.parametrize(("command", "option", "value"), list(_cases()))
def test_a_number_out_of_range_is_refused_in_one_line_before_any_work(capsys, command, option, value):
    if command == "check-driver":
        code = check_driver("host", [f"{option}={value}", "-k", "no_rule_has_this_name", "-p", "no:randomly"])
    else:
        with pytest.raises(SystemExit) as exited:  # argparse's refusal
            main(["validate-backend", GOOD_BACKEND, "--driver", "host-4k", f"{option}={value}"])
        code = exited.value.code
    out, err = capsys.readouterr()
    lines = err.splitlines()
    shown = repr(value)[:40].rstrip("'")
    got = {
        "exit": code,
        "lines": len(lines),
        "names option and value": bool(lines) and option in lines[0] and shown in lines[0],
        "ran": bool(out),
    }
    want = {"exit": 2, "lines": 1, "names option and value": True, "ran": False}
    assert got == want, f"{command} {option} {value[:20]!r}: expected {want}, got {got}\n{out[-500:]}{err[-500:]}"


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=30), st.floats().map(repr), st.integers().map(str), st.sampled_from(list(VALUES.values()))
    )
)
def test_a_time_limit_is_returned_in_range_or_refused(text):
    try:
        value = numbers.seconds(text, option="--t")
    except numbers.BadNumber as exc:
        assert str(exc).startswith("--t must be") and "\n" not in str(exc), f"seconds({text!r}) refused as {exc}"
        return
    assert math.isfinite(value) and 0 <= value <= numbers.SECONDS_LIMIT, f"seconds({text!r}) returned {value}"


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=30),
        st.floats().map(repr),
        st.integers().map(str),
        st.sampled_from(list(VALUES.values())),
        st.from_regex(r"\s?[+-]{0,3}[0-9]{0,45}\s?", fullmatch=True),  # signs and digits in any number: "+-5"
    )
)
def test_a_count_is_returned_in_range_or_refused(text):
    try:
        value = numbers.integer(text, option="--n", high=numbers.ADDRESS_SPACE)
    except numbers.BadNumber as exc:
        assert str(exc).startswith("--n must be") and "\n" not in str(exc), f"integer({text!r}) refused as {exc}"
        return
    assert isinstance(value, int) and 1 <= value <= numbers.ADDRESS_SPACE, f"integer({text!r}) returned {value}"
