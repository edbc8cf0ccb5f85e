"""The replay of torch's allocation history (``integration/memory_trace.py``): the peak above the trace's start,
the blocks live at it and where they were allocated, on snapshot dictionaries shaped as torch writes them."""

from __future__ import annotations

from integration.memory_trace import peak_of


def _frames(*names: str) -> list[dict]:
    return [{"filename": f"/site-packages/vllm/{n}.py", "line": i + 1, "name": n} for i, n in enumerate(names)]


def _alloc(addr: int, size: int, *where: str) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": _frames(*where)}


def _free(addr: int, size: int, action: str = "free_requested") -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": []}


def _snapshot(*entries: dict) -> dict:
    return {"segments": [], "device_traces": [list(entries)]}


def test_the_peak_is_the_most_allocated_above_the_start_and_names_what_was_live():
    got = peak_of(
        _snapshot(
            _alloc(1, 100, "logits", "sampler"),
            _alloc(2, 50, "attention"),
            _free(1, 100),
            _free(1, 100, "free_completed"),
            _alloc(3, 30, "mlp"),
        )
    )
    assert (got["peak"], got["peak_event"], got["live_at_peak"]) == (150, 1, 150)
    assert [(g["bytes"], g["count"]) for g in got["groups"]] == [(100, 1), (50, 1)]
    assert got["groups"][0]["where"].startswith("vllm/logits.py:1 logits")
    assert got["blocks"][0]["frames"] == ["vllm/logits.py:1 logits", "vllm/sampler.py:2 sampler"]


def test_a_free_requested_then_completed_is_counted_once():
    # counted twice, the free would hide the second allocation's 150 bytes behind the first's 100
    entries = (_alloc(1, 100, "a"), _free(1, 100), _free(1, 100, "free_completed"), _alloc(2, 150, "b"))
    got = peak_of(_snapshot(*entries))
    assert (got["peak"], got["peak_event"]) == (150, 3)


def test_a_trace_without_requests_counts_the_completions():
    got = peak_of(_snapshot(_alloc(1, 100, "a"), _free(1, 100, "free_completed"), _alloc(2, 60, "b")))
    assert (got["peak"], got["peak_event"]) == (100, 0)


def test_blocks_from_before_the_trace_lower_the_peak_and_are_named_apart():
    got = peak_of(_snapshot(_free(9, 200), _alloc(1, 150, "a"), _alloc(2, 100, "b")))
    assert (got["peak"], got["freed_from_before"], got["live_at_peak"]) == (50, 200, 250)


def test_an_empty_trace_has_no_peak():
    assert peak_of({"segments": [], "device_traces": []})["peak"] == 0
    assert peak_of(_snapshot())["groups"] == []
