"""The drivers of ``broken_unlocked`` (one per effectful method, each letting go of its lock between its records and its
kernel call): the break is real (its proof, as in ``test_broken_protocol``), and the rule of contended pairs
(``conformance/test_contended_pairs.py``, its machinery in ``conformance/protocol_pairs.py``) catches each, run in this
process on the pairs in their order up to the first failure. With ``EXTENSIBLE_KV_BROKEN_DRIVERS=1`` each also fails
``extensible-kv check-driver`` run on that rule, as a backend team runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.protocol_pairs import PAIRS, run_pair
from extensible_kv.drivers import Ledger
from tests.meta import broken_unlocked
from tests.meta.broken_unlocked import CASES, intact

ROOT = Path(__file__).resolve().parents[2]
RUN_ENV = "EXTENSIBLE_KV_BROKEN_DRIVERS"


@pytest.mark.parametrize("name", CASES)
def test_the_proof_shows_the_break(name):
    case = CASES[name]
    seen_intact, seen_broken = case.proof(intact), case.proof(case.factory)
    assert seen_intact == case.want and seen_broken != case.want, (
        f"broken driver unlocked:{name} ({case.area}), {case.proof.__name__}: expected the intact host driver to "
        f"observe {case.want!r} and the broken one something else; the intact one observed {seen_intact!r}, the "
        f"broken one {seen_broken!r}"
    )


def first_caught(make) -> tuple[str, str] | None:
    """The first pair of ``PAIRS`` that fails on a driver ``make()`` builds, and its failure; ``None`` if none does."""
    for pair in PAIRS:
        try:
            run_pair(Ledger(make()), pair)
        except AssertionError as exc:
            return pair, str(exc)
    return None


@pytest.mark.parametrize("name", CASES)
def test_the_contended_pairs_rule_catches_it(name):
    caught = first_caught(CASES[name].factory)
    driver = CASES[name].factory().name
    assert caught is not None, f"broken driver unlocked:{name}: expected a pair of {PAIRS} to fail, every one passed"
    pair, message = caught
    assert message.startswith(f"driver {driver}: {pair}"), (
        f"broken driver unlocked:{name}: expected the failure to name the driver {driver!r} and the pair {pair!r}, "
        f"got {message[:300]!r}"
    )


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(RUN_ENV) != "1", reason=f"{RUN_ENV}=1 runs check-driver on each broken driver")
@pytest.mark.parametrize("name", CASES)
def test_check_driver_on_the_contended_pairs_rule_fails(name):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXTENSIBLE_KV_", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "reference"), os.environ.get("PYTHONPATH", "")])
    spec = f"{broken_unlocked.__name__}:{CASES[name].factory.__name__}"
    cmd = [sys.executable, "-m", "extensible_kv", "check-driver", spec, "--", "-x", "-q", "-p", "no:cacheprovider"]
    cmd += ["-k", "test_contended_pairs"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode in (1, 2) and "test_each_contended_pair" in out and "FAILED" in out, (
        f"check-driver {spec} -k test_contended_pairs: expected a failed pair (exit 1, or 2 when xdist stops at the "
        f"first failure), got exit {proc.returncode}\n{out[-3000:]}"
    )
