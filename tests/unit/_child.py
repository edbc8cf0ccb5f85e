"""Run a test's hostile part in a fresh interpreter, so a deadlock is a failure after a deadline instead of a hung
run, and a fork or a collection inside a driver call cannot take the test process with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_child(code: str, what: str, timeout_s: float = 60) -> dict:
    """Run ``code`` (dedented) with the package importable; it prints one JSON object as its last line, returned
    here. A hang past ``timeout_s``, a non-zero exit or no JSON fails the test naming ``what``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "reference"), str(ROOT)])}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what}: the child hung for {timeout_s} s (a deadlock); stdout {exc.stdout!r}", pytrace=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"{what}: expected exit 0 and a JSON line, got exit {proc.returncode}, stdout {proc.stdout[-2000:]!r}, "
            f"stderr {proc.stderr[-3000:]!r}",
            pytrace=False,
        )
    return json.loads(lines[-1])


def fake_driver(kind: str) -> str:
    """Code for ``run_child`` that builds the ``kind`` driver (``cuda`` or ``hip``) named ``unit-{kind}`` over its
    fake bindings (``_fake_cuda``, ``_fake_hip``), torch's CUDA calls stood in for, and the fake's native unmap
    running the callables put in ``INSIDE`` first (under the driver's lock). It defines ``drv``, ``fake``, ``g`` and
    ``records()`` (the driver's records and the fake's state, comparable with ``==``)."""
    return f"""
    from types import SimpleNamespace
    import torch

    KIND = {kind!r}
    INSIDE = []
    if KIND == "cuda":
        import extensible_kv.drivers.cuda as module
        from tests.unit._fake_cuda import FakeCuda as Fake
        UNMAP = "cuMemUnmap"
        torch.cuda.is_available = lambda: True
        torch.cuda.init = lambda: None
    else:
        import extensible_kv.drivers.hip as module
        from tests.unit._fake_hip import FakeHip as Fake
        UNMAP = "hipMemUnmap"
        module._torch_reason = lambda ordinal: None
    torch.cuda.current_stream = lambda device=None: SimpleNamespace(cuda_stream=0x5EED)
    torch.cuda.synchronize = lambda device=None: None

    class Hooked(Fake):
        pass

    def _unmap(self, *args, real=getattr(Fake, UNMAP)):
        while INSIDE:
            INSIDE.pop()()
        return real(self, *args)

    setattr(Hooked, UNMAP, _unmap)
    fake = Hooked()
    module._bindings = lambda: fake
    drv = module.CudaDriver(name="unit-cuda") if KIND == "cuda" else module.HipDriver(name="unit-hip")
    g = drv.granularity()

    def records():
        reserved = {{va: r[0] if KIND == "hip" else r for va, r in drv._reservations.items()}}  # hip: (size, raw...)
        mine = [reserved, dict(drv._mappings), set(getattr(drv, "_live", ()))]
        theirs = [dict(fake.reservations), {{va: m[0] for va, m in fake.mappings.items()}}, len(fake.live_handles())]
        return mine + theirs
"""
