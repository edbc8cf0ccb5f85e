"""Whatever a driver factory returns is judged as an object (Note [A factory's result is judged as an object]): a
driver object passes as it is, anything else is ``NotADriver`` naming what it is, never read as a spec.

The class: plain values (``None``, a driver name, numbers, containers), objects missing each one of the protocol's
methods and attributes in turn, and drivers whose ``name`` or ``device`` is of the wrong type. (The command line's
answer to such factories, exit 2 and one line, and to factories that leave a thread or a process running, is in
``test_check_driver_boundary.py``.)
"""

from __future__ import annotations

import pytest
import torch

from extensible_kv.boundaries import factories
from extensible_kv.drivers._protocol import DRIVER_ATTRIBUTES, DRIVER_METHODS
from extensible_kv.drivers.host import HostDriver

PLAIN = {"None": None, "name": "host", "spec": "pkg.mod:factory", "int": 0, "list": [], "dict": {}, "bytes": b"host"}


def _driver_class():
    return type("Complete", (), {m: (lambda self, *a: None) for m in DRIVER_METHODS})


def _lacking(missing: str) -> object:
    """A driver-shaped object without ``missing`` (a method or an attribute)."""
    cls = _driver_class()
    if missing in DRIVER_METHODS:
        delattr(cls, missing)
    obj = cls()
    for name in DRIVER_ATTRIBUTES:
        if name != missing:
            setattr(obj, name, {"name": "x", "device": torch.device("cpu"), "max_handle_bytes": None}[name])
    return obj


def _with(name: object, device: object) -> object:
    obj = _driver_class()()
    obj.name, obj.device, obj.max_handle_bytes = name, device, None
    return obj


CASES = {f"plain-{k}": (v, "not a driver object") for k, v in PLAIN.items()}
CASES |= {f"lacks-{m}": (_lacking(m), f"lacks the protocol's {m}") for m in DRIVER_METHODS + DRIVER_ATTRIBUTES}
CASES |= {
    "name-None": (_with(None, torch.device("cpu")), "whose name is None"),
    "name-empty": (_with("", torch.device("cpu")), "whose name is str ''"),
    "name-int": (_with(3, torch.device("cpu")), "whose name is int"),
    "device-text": (_with("x", "cpu"), "whose device is str 'cpu'"),
    "device-None": (_with("x", None), "whose device is None"),
}


@pytest.mark.parametrize(("built", "words"), CASES.values(), ids=CASES.keys())
def test_what_is_not_a_driver_object_is_refused_naming_it(built, words):
    with pytest.raises(factories.NotADriver) as refused:
        factories.judge(built, "driver spec 'x:f': its factory")
    message = str(refused.value)
    assert message.startswith("driver spec 'x:f': its factory returned ") and words in message, (
        f"judge({type(built).__name__}): expected a NotADriver saying {words!r}, got {message!r}"
    )
    assert "\n" not in message, f"judge: expected one line, got {message!r}"


def test_a_driver_object_is_returned_as_it_is():
    driver = HostDriver(granularity=4096, name="judged")
    assert factories.judge(driver, "f") is driver, "judge(HostDriver): expected the same object back"
    complete = _with("x", torch.device("cpu"))
    assert factories.judge(complete, "f") is complete, "judge(a complete driver-shaped object): expected it back"
