"""Measurement files are written whole or not at all (``extensible_kv_lab.measurements.write``), and read back only with
numbers that hardware can hold."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from extensible_kv.boundaries import outputs
from extensible_kv_lab.measurements import BadFile, CaseSpec, IntegrationCase, read, write


class _HalfThenInterrupt(io.FileIO):
    """A file whose first write writes half its bytes, then is interrupted."""

    def write(self, data):
        super().write(bytes(data)[: len(data) // 2])
        raise KeyboardInterrupt


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("cut", ["mid-write", "before-rename"])
def test_a_write_cut_short_leaves_the_file_as_it_was_and_nothing_beside_it(tmp_path, monkeypatch, cut):
    path = tmp_path / "case.json"
    write(path, CaseSpec(model="first", runner="v1", backend="FLASH_ATTN", mode="legacy"))
    before = path.read_text()
    if cut == "mid-write":
        monkeypatch.setattr(outputs.os, "fdopen", lambda fd, mode: _HalfThenInterrupt(fd, "wb"))
    else:
        monkeypatch.setattr(outputs.os, "replace", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        write(path, CaseSpec(model="second", runner="v2", backend="FLASH_ATTN", mode="extensible"))
    monkeypatch.undo()
    got = (path.read_text() == before, sorted(p.name for p in tmp_path.iterdir()))
    assert got == (True, ["case.json"]), (
        f"measurements.write interrupted {cut}: expected case.json unchanged and alone, got (unchanged, files) = {got}"
    )


def test_a_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "sub" / "case.json"
    write(path, CaseSpec(model="first", runner="v1", backend="FLASH_ATTN", mode="legacy"))
    write(path, CaseSpec(model="second", runner="v2", backend="FLASH_ATTN", mode="extensible"))
    got = CaseSpec.model_validate_json(path.read_text())
    files = sorted(p.name for p in path.parent.iterdir())
    assert (got.model, files) == ("second", ["case.json"]), (
        f"measurements.write twice: expected the second model alone in the folder, got {got.model!r} and {files}"
    )


# -- numbers a device can hold (Note [Numbers a device can hold] in extensible_kv_lab.measurements) ----------------
CASE = (
    Path(__file__).resolve().parent
    / "report_fixtures"
    / "full"
    / "integration"
    / "call1"
    / "tiny-llama-v1-FLASH_ATTN-extensible.json"
)


def _case_with(tmp_path: Path, path: tuple, value: object) -> Path:
    data = json.loads(CASE.read_text())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    out = tmp_path / "case.json"
    out.write_text(json.dumps(data))
    return out


BEYOND = [
    (("memory", "total"), 10**400, "memory.total"),  # bytes
    (("memory", "peak", "over_budget_measured"), -(10**400), "memory.peak.over_budget_measured"),  # signed bytes
    (("memory", "num_gpu_blocks"), 2**40, "memory.num_gpu_blocks"),  # blocks: a trillion is beyond any device
    (("extensible", "commit_seconds"), 10**400, "extensible.commit_seconds"),  # a number (int or float)
    (("engine_seconds",), 1e300, "engine_seconds"),  # a float that any unit conversion would take to infinity
    (("token_ids", 0, 0), 10**400, "token_ids[0][0]"),
    (("case", "block_size"), 10**400, "case.block_size"),  # a field the schema does not name
    (("extensible", "kv", "buffers", 0, "bytes"), 10**400, "extensible.kv.buffers[0].bytes"),  # an ``Any`` field
]


@pytest.mark.parametrize("path,value,field", BEYOND, ids=[field for _, _, field in BEYOND])
def test_a_number_beyond_what_hardware_holds_is_refused_naming_the_file_and_field(tmp_path, path, value, field):
    bad = _case_with(tmp_path, path, value)
    with pytest.raises(BadFile) as caught:
        read(bad, IntegrationCase)
    message = str(caught.value)
    assert message.startswith(f"{bad}: {field} should be ") and ("2**63" in message or "2**40" in message), (
        f"read(IntegrationCase) of {field} = {str(value)[:20]}: expected a BadFile naming the file, the field and "
        f"its limit, got {message!r}"
    )


def test_the_largest_numbers_a_device_holds_are_kept(tmp_path):
    ok = read(_case_with(tmp_path, ("memory", "num_gpu_blocks"), 2**40 - 1), IntegrationCase)
    assert ok.memory.num_gpu_blocks == 2**40 - 1, (
        f"read(IntegrationCase): expected 2**40 - 1 blocks kept, got {ok.memory.num_gpu_blocks}"
    )
    ok = read(_case_with(tmp_path, ("memory", "total"), 2**63 - 1), IntegrationCase)
    assert ok.memory.total == 2**63 - 1, f"read(IntegrationCase): expected 2**63 - 1 bytes kept, got {ok.memory.total}"
