"""Model-based rules of the tensor's and the KV buffers' whole life: random sequences of every public transition,
valid and invalid (construction and ``check_shrink`` included), pins, interrupts at any line of a whole step, every
driver call of a step made to fail in turn, calls from inside a driver call, forks and user finalizers, each
compared after every step with the executable model (``lifecycle_model.py``): state, committed bytes, data, views,
memory, refusals' messages and the driver's records.

Examples: ``EXTENSIBLE_KV_LIFECYCLE_EXAMPLES`` sets the number of examples of each machine (a stress run sets
thousands); by default ``SHARE`` times the profile's ``max_examples`` (at least ``MIN_EXAMPLES``), each at most
``STEPS`` steps.
"""

from __future__ import annotations

import gc
import os

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from .lifecycle_model import HostileLifecycleMachine, LifecycleMachine

EXAMPLES_ENV = "EXTENSIBLE_KV_LIFECYCLE_EXAMPLES"
SHARE = 4  # times the profile's max_examples: 100 in CI (25)
HOSTILE_SHARE = 2  # 50 in CI
MIN_EXAMPLES = 5
STEPS = 50
SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
}


def _examples(share: float) -> int:
    return int(os.environ.get(EXAMPLES_ENV) or 0) or max(round(settings.default.max_examples * share), MIN_EXAMPLES)


def _run(machine, driver, share: float) -> None:
    gc.collect()
    gc.freeze()  # what exists now is never this machine's garbage: the collections of every step scan only its own
    try:
        run_state_machine_as_test(
            lambda: machine(driver),
            settings=settings(settings.default, max_examples=_examples(share), stateful_step_count=STEPS, **SETTINGS),
        )
    finally:
        gc.unfreeze()


def test_the_lifecycle_matches_the_model(driver):
    """Tensors and a worker's KV cache: growth and shrink valid and invalid, views of every dtype, writes,
    checkpoints and rollbacks, pins, release and recommit, sleep with and without a registered connector, close,
    interrupts at any line of a step, driver calls that fail, and a drawn cap on a handle's size."""
    _run(LifecycleMachine, driver, SHARE)


def test_forks_and_user_finalizers_match_the_model(driver):
    """The same, with a fork at any line of an operation (the child's calls are refused with typed errors, never
    hang) and a user finalizer that closes another tensor, collected at any line of an operation (no deadlock)."""
    _run(HostileLifecycleMachine, driver, HOSTILE_SHARE)
