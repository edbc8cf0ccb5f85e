"""Measurement files are written whole or not at all (``extensible_kv.measurements.write``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from extensible_kv.measurements import CaseSpec, write


def test_a_write_cut_short_leaves_the_file_as_it_was_and_nothing_beside_it(tmp_path, monkeypatch):
    path = tmp_path / "case.json"
    write(path, CaseSpec(model="first", runner="v1", backend="FLASH_ATTN", mode="legacy"))
    before = path.read_text()
    real = Path.write_text

    def half_then_interrupt(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        write(path, CaseSpec(model="second", runner="v2", backend="FLASH_ATTN", mode="extensible"))
    monkeypatch.undo()
    got = (path.read_text() == before, sorted(p.name for p in tmp_path.iterdir()))
    assert got == (True, ["case.json"]), f"measurements.write interrupted mid-file: expected case.json unchanged " \
                                         f"and alone, got (unchanged, files) = {got}"


def test_a_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "sub" / "case.json"
    write(path, CaseSpec(model="first", runner="v1", backend="FLASH_ATTN", mode="legacy"))
    write(path, CaseSpec(model="second", runner="v2", backend="FLASH_ATTN", mode="extensible"))
    got = CaseSpec.model_validate_json(path.read_text())
    files = sorted(p.name for p in path.parent.iterdir())
    assert (got.model, files) == ("second", ["case.json"]), f"measurements.write twice: expected the second model " \
                                                            f"alone in the folder, got {got.model!r} and {files}"
