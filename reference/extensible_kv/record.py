"""The JSON files the runtime writes: ``environment.json`` (``python -m extensible_kv environment``, and beside the
conformance summary), ``validate-backend --json`` and the suite's ``--summary-json``.

Plain dicts written whole through ``boundaries.outputs``, with nothing beyond the runtime's own requirements. Their
schema, and every reader, is the lab's (``extensible_kv_lab.measurements``, ``pip install ./lab`` from a checkout):
tests/unit/test_measurement_files.py reads what is written here through it.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from .boundaries import outputs

PACKAGES = ("cuda-bindings", "hip-python", "vllm", "pytest-benchmark")  # versions environment.json records


def write(path: str | Path, data: dict) -> Path:
    """``data`` as indented JSON in ``path``, whole or not at all (``boundaries.outputs.write_file``)."""
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    return outputs.write_file(path, text.encode("utf-8", "backslashreplace"), option="measurement file")


def environment() -> dict:
    """This machine, now: torch's versions and first GPU, the NVIDIA driver (``nvidia-smi``'s CSV query, where there
    is one), python, the platform and the installed versions of ``PACKAGES``."""
    import torch

    gpu = memory = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu, memory = props.name, int(props.total_memory)
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "gpu_memory": memory,
        "gpu_driver": _nvidia_driver(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": packages,
    }


def _nvidia_driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None
