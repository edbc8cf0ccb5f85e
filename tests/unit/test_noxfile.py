"""Where the nox sessions take torch from (Note [torch's CPU build on a machine without a GPU] in noxfile.py): the
CPU index on a machine without a GPU, nothing of their own where the machine has a GPU or names its own pip
sources (the CI machine pins its local CPU wheel with PIP_CONSTRAINT and reaches PyPI only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU = "https://download.pytorch.org/whl/cpu"

CASES = {
    "no GPU, nothing configured": ({}, False, CPU),
    "a GPU": ({}, True, None),
    "the CI machine's constraint file": ({"PIP_CONSTRAINT": "/ci/cpu-constraints.txt"}, False, None),
    "an index of its own": ({"PIP_INDEX_URL": "https://mirror.example/simple"}, False, None),
    "an extra index": ({"PIP_EXTRA_INDEX_URL": CPU}, False, None),
    "find-links": ({"PIP_FIND_LINKS": "/opt/wheels"}, False, None),
    "no index": ({"PIP_NO_INDEX": "1"}, False, None),
    "an empty variable is no source": ({"PIP_CONSTRAINT": ""}, False, CPU),
    "another index named": (
        {"EXTENSIBLE_KV_TORCH_INDEX": "https://mirror.example/cpu"},
        False,
        "https://mirror.example/cpu",
    ),
    "named even over a constraint file": ({"EXTENSIBLE_KV_TORCH_INDEX": CPU, "PIP_CONSTRAINT": "c.txt"}, False, CPU),
    "the step turned off": ({"EXTENSIBLE_KV_TORCH_INDEX": ""}, False, None),
}


@pytest.mark.parametrize(("environ", "gpu", "expected"), CASES.values(), ids=CASES.keys())
def test_the_sessions_take_torch_from_the_cpu_index_only_on_a_machine_without_gpu_or_pip_sources(
    environ, gpu, expected
):
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile  # noqa: PLC0415
    finally:
        sys.path.remove(str(ROOT))
    got = noxfile.torch_index(environ, gpu)
    assert got == expected, f"torch_index({environ}, gpu={gpu}): expected {expected!r}, got {got!r}"


@pytest.mark.parametrize(
    ("environ", "gpu", "words"),
    [
        ({}, False, "no GPU here"),
        ({}, True, "has a GPU"),
        ({"PIP_FIND_LINKS": "/w"}, False, "PIP_FIND_LINKS"),
        ({"EXTENSIBLE_KV_TORCH_INDEX": ""}, False, "set empty"),
    ],
    ids=["cpu", "gpu", "find-links", "off"],
)
def test_the_sessions_say_why_they_take_torch_from_where_they_do(environ, gpu, words):
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile  # noqa: PLC0415
    finally:
        sys.path.remove(str(ROOT))
    index, why = noxfile.torch_source(environ, gpu)
    assert words in why, f"torch_source({environ}, gpu={gpu}): expected a reason naming {words!r}, got {why!r}"
