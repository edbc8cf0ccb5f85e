"""VMM drivers: the protocol, the built-in drivers, and a registry by name.

A driver is named either by a registered name (``host``, ``host-4k``, ``cuda``, ``hip``, ``vllm``) or by
``module:factory``, where ``factory`` is a zero-argument callable in an importable module that returns a driver.
``get_driver`` resolves both; ``probe`` says why a registered driver cannot run here; ``best_available`` picks the
GPU driver when one works and the host driver otherwise (of those registered with ``auto``); ``resolve`` turns a
``driver=`` argument (a driver, a spec or ``None``) into a driver. ``install_command`` says how to install the extra a
driver needs, the way this copy was installed.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import DriverLoadError, DriverUnavailable, ExtensibleKVError
from . import cuda as _cuda
from . import hip as _hip
from . import host as _host
from . import vllm_vmm as _vllm_vmm
from ._device_array import DeviceArray
from ._protocol import DRIVER_ATTRIBUTES, DRIVER_METHODS, Driver, Handle, conforming, protocol_methods
from .ledger import Ledger

__all__ = [
    "Driver",
    "Handle",
    "Ledger",
    "DeviceArray",
    "register",
    "registered",
    "probe",
    "get_driver",
    "best_available",
    "resolve",
    "install_command",
    "DRIVER_METHODS",
    "DRIVER_ATTRIBUTES",
    "protocol_methods",
]


@dataclass(frozen=True)
class _Entry:
    factory: Callable[[], Driver]
    probe: Callable[[], str | None]
    gpu: bool
    extra: str | None = None  # the package extra that brings the driver's bindings
    auto: bool = True  # whether best_available may pick it


_REGISTRY: dict[str, _Entry] = {}


def register(
    name: str,
    factory: Callable[[], Driver],
    probe: Callable[[], str | None],
    *,
    gpu: bool,
    extra: str | None = None,
    auto: bool = True,
) -> None:
    """Register a driver under ``name``; ``probe()`` returns ``None`` when it can run, else the reason. ``extra``
    names the extra of this package that installs what the driver needs (its probe's reason then ends with the
    command that installs it). ``auto=False``: ``best_available`` never picks it (a driver that is there to be
    judged, such as ``vllm``, is used only when named)."""
    if not name or ":" in name:
        raise DriverLoadError(f"driver names must be non-empty and contain no ':', got {name!r}")
    _REGISTRY[name] = _Entry(factory, probe, gpu, extra, auto)


def _checkout() -> Path | None:
    """The source checkout this package runs from (its ``pyproject.toml`` two folders up, as in ``reference/``), or
    ``None`` where it was installed from a wheel."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() and (root / "reference" / "extensible_kv").is_dir() else None


def install_command(extra: str) -> str:
    """The command that installs ``extra``: from an index, or, running from a source checkout, editable from it."""
    root = _checkout()
    if root is None:
        return f"pip install 'extensible-kv[{extra}]'"
    where = "." if Path(os.getcwd()).resolve() == root else str(root)
    return f"pip install -e '{where}[{extra}]'"


def registered() -> list[str]:
    """Registered driver names, GPU drivers first."""
    return sorted(_REGISTRY, key=lambda n: (not _REGISTRY[n].gpu, n))


def probe(name: str) -> str | None:
    """Why the registered driver ``name`` cannot run here, or ``None`` when it can."""
    if name not in _REGISTRY:
        raise DriverLoadError(f"unknown driver {name!r}; registered: {', '.join(registered())}")
    entry = _REGISTRY[name]
    return _with_install_command(entry.probe(), entry.extra)


def _with_install_command(reason: str | None, extra: str | None) -> str | None:
    """``reason``, where it asks for ``extra``, ending with the command that installs it here (in place of any
    command the driver's probe named)."""
    if reason is None or extra is None or f"'{extra}' extra" not in reason:
        return reason
    reason = re.sub(r"\s*\(pip install [^)]*\)", "", reason)
    return f"{reason} ({install_command(extra)})"


def best_available() -> str:
    """The first registered GPU driver (of those it may pick) whose probe passes, else ``host``."""
    for name in registered():
        if _REGISTRY[name].gpu and _REGISTRY[name].auto and _REGISTRY[name].probe() is None:
            return name
    return "host"


def get_driver(spec: str) -> Driver:
    """Build the driver named by ``spec``: a registered name or ``module:factory``.

    Raises ``DriverLoadError`` for an unknown name, a module that does not import (whatever its import raised), a
    missing factory, a factory that raises an untyped error (one that needs arguments, say) or returns something
    without the protocol's methods; ``DriverUnavailable`` when the driver cannot run here; a typed error the
    factory raises, as it is.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DriverLoadError(f"a driver spec is a registered name or 'module:factory', got {spec!r}")
    if ":" not in spec:
        reason = probe(spec)
        if reason:
            raise DriverUnavailable(f"driver {spec!r} is unavailable: {reason}")
        driver = _REGISTRY[spec].factory()
        return conforming(f"driver {spec!r} built {type(driver).__name__}", driver)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise DriverLoadError(f"driver spec {spec!r} must look like 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any error while it imports (ImportError, SyntaxError, what its code raises)
        raise DriverLoadError(
            f"driver spec {spec!r}: module {module_name!r} does not import: {type(exc).__name__}: {exc}"
        ) from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise DriverLoadError(f"driver spec {spec!r}: {module_name} has no callable {attr!r}")
    try:
        driver = factory()
    except ExtensibleKVError:  # the factory's own typed refusal (DriverUnavailable, DriverError): as it is
        raise
    except Exception as exc:  # a factory that needs arguments, or fails in its own way
        raise DriverLoadError(
            f"driver spec {spec!r}: {module_name}.{attr}() raised {type(exc).__name__}: {exc}"
        ) from exc
    return conforming(f"driver spec {spec!r} built {type(driver).__name__}", driver)


def resolve(driver: Driver | str | None) -> Driver:
    """The driver a ``driver=`` argument names: ``None`` is ``best_available()``, a string is built by
    ``get_driver``, anything else must be a driver object (``DriverLoadError`` names what it lacks)."""
    if driver is None:
        driver = best_available()
    if isinstance(driver, str):
        return get_driver(driver)
    return conforming(f"driver={driver!r} is a {type(driver).__name__}", driver)


register("host", lambda: _host.HostDriver(budget_bytes=1 << 30), _host.probe, gpu=False)
register(
    "host-4k", lambda: _host.HostDriver(granularity=4096, name="host-4k", budget_bytes=1 << 30), _host.probe, gpu=False
)
register("cuda", _cuda.CudaDriver, _cuda.probe, gpu=True, extra="cuda")
register("hip", _hip.HipDriver, _hip.probe, gpu=True, extra="rocm")
register("vllm", _vllm_vmm.VllmVmmDriver, _vllm_vmm.probe, gpu=True, auto=False)
