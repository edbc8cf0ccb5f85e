"""Deliberately broken host drivers: each breaks one sentence of the driver protocol, and the rules must catch it.

One module per protocol method or promise family (``map``, ``unmap``, ``threads``, ...); every driver is a small
subclass of ``base.Broken`` (the host driver, through the surface Note [Subclassing the host driver] in
``drivers/host.py`` documents) that names the protocol sentence it breaks (``breaks``, its P-id) and the rules of which
at least one must fail on it (``caught_by``). ``drivers()`` lists them all by spec; each is its own factory, used as
``extensible-kv check-driver tests.meta.broken.<module>:<Class>``.

``tests/meta/test_broken_caught.py`` runs, in CI, each driver's own rules (``catch``: seconds a driver) and fails
unless one fails; ``nox -s broken_sweep`` runs every rule on every driver.

Two drivers that break the same sentence and fail the same rules are one: a second adds nothing to what the rules are
shown to catch.
"""

from __future__ import annotations

import importlib
import pkgutil

SUPPORT = ("base", "catch")
"""The modules of this package that hold no driver."""


def drivers() -> dict[str, type]:
    """Every broken driver by its spec, ``tests.meta.broken.<module>:<Class>``, module by module."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in SUPPORT:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for attr, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module.__name__ and getattr(value, "breaks", ""):
                found[f"{module.__name__}:{attr}"] = value
    return found
