"""What is live at a step's allocated peak, and where it was allocated: torch's allocation history
(``torch.cuda.memory._record_memory_history``) cleared when a window opens, read when it closes, replayed to the
moment the window's live tensors peaked.

Used by the worst-batch matrix (``worst_batch_run one --trace-memory``) to compare a served step with the dummy
batches that are meant to bound it: each worst batch and vLLM's profile run (``trace_engine_start``), and the
served step that allocated the most (``load_generator.drive``'s readings). ``peak_of`` is the replay, testable
without a GPU on a snapshot's dictionary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

MAX_ENTRIES = 200_000  # events kept between two windows; a window of a step is a few thousand
GROUPS = 12  # allocation sites reported per peak
BLOCKS = 6  # largest live blocks reported per peak, with their stacks
FRAMES = 8  # frames kept per block
OWN = ("/vllm/", "/extensible_kv/", "/integration/", "torchinductor")


def _site(frames: list[dict]) -> str:
    """The innermost frame, and the innermost frame of vLLM, this project or inductor's generated code."""
    if not frames:
        return "(no Python frame)"
    inner = frames[0]
    own = next((f for f in frames if any(k in f.get("filename", "") for k in OWN)), None)
    where = f"{_short(inner)}"
    if own is not None and own is not inner:
        where += f" <- {_short(own)}"
    return where


def _short(frame: dict) -> str:
    name = frame.get("filename", "?")
    for key in ("/vllm/", "/extensible_kv/", "/integration/", "/torch/"):
        if key in name:
            name = key.strip("/") + "/" + name.split(key, 1)[1]
            break
    else:
        name = name.rsplit("/", 1)[-1]
    return f"{name}:{frame.get('line', '?')} {frame.get('name', '?')}"


def _replay(entries: list[dict], upto: int | None = None) -> Iterator[tuple[int, int, dict[int, dict], int]]:
    """Each event's index, the bytes allocated above the trace's start after it, the blocks allocated within the
    trace still live, and the bytes of blocks from before the trace freed so far. torch lowers its allocated
    bytes when a free is requested (``free_completed`` follows once the streams are done); a trace without
    requests counts the completions."""
    free = "free_requested" if any(e.get("action") == "free_requested" for e in entries) else "free_completed"
    now = freed_before = 0
    live: dict[int, dict] = {}
    for i, e in enumerate(entries if upto is None else entries[: upto + 1]):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            now += e["size"]
        elif action == free:
            now -= e["size"]
            if live.pop(e["addr"], None) is None:
                freed_before += e["size"]
        yield i, now, live, freed_before


def peak_of(snapshot: dict, device: int = 0) -> dict:
    """Replay the snapshot's trace on ``device``: the most bytes allocated above the trace's start (``peak``),
    the event at which it was reached, and the blocks allocated within the trace still live then, grouped by
    allocation site (``groups``) and the largest ones with their stacks (``blocks``). Blocks allocated before the
    trace began and freed by the peak (``freed_from_before``) lower the peak; they are not in the groups."""
    traces = snapshot.get("device_traces") or []
    entries = traces[device] if device < len(traces) else []
    peak, peak_at = 0, -1
    for i, now, _live, _before in _replay(entries):
        if now > peak:
            peak, peak_at = now, i
    at_peak: dict[int, dict] = {}
    freed_before = 0
    for _i, _now, live, before in _replay(entries, peak_at):
        at_peak, freed_before = live, before
    if peak_at < 0:
        at_peak = {}
    groups: dict[str, list[int]] = {}
    for e in at_peak.values():
        g = groups.setdefault(_site(e.get("frames") or []), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    largest = sorted(at_peak.values(), key=lambda e: -e["size"])[:BLOCKS]
    return {
        "peak": peak,
        "events": len(entries),
        "peak_event": peak_at,
        "live_at_peak": sum(e["size"] for e in at_peak.values()),
        "freed_from_before": freed_before,
        "groups": [{"where": w, "bytes": b, "count": n} for w, (b, n) in ranked[:GROUPS]],
        "other_bytes": sum(b for _, (b, _n) in ranked[GROUPS:]),
        "blocks": [
            {"bytes": e["size"], "frames": [_short(f) for f in (e.get("frames") or [])[:FRAMES]]} for e in largest
        ],
    }


# -- on the GPU ----------------------------------------------------------------------------------------------------
def open_window() -> None:
    """Start recording allocations with their Python stacks, forgetting every event before."""
    import torch

    torch.cuda.memory._record_memory_history(
        "all", context="alloc", stacks="python", max_entries=MAX_ENTRIES, clear_history=True
    )


def close_window() -> dict:
    """The replay of every event since ``open_window`` (recording stays on)."""
    import torch

    torch.cuda.synchronize()
    return peak_of(torch.cuda.memory._snapshot(), torch.cuda.current_device())


def stop() -> None:
    import torch

    torch.cuda.memory._record_memory_history(None)


@contextmanager
def engine_start(found: dict) -> Iterator[None]:
    """Within the block, every worst batch (``probes.run_batch``) and every ``profile_run`` of a model runner is
    a window, recorded alone; ``found['worst_batches']`` and ``found['profile_runs']`` get their replays, in
    order."""
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu import model_runner as v2_model_runner

    from extensible_kv.vllm import probes

    found.setdefault("worst_batches", [])
    found.setdefault("profile_runs", [])
    run_batch = probes.run_batch
    classes = (gpu_model_runner.GPUModelRunner, v2_model_runner.GPUModelRunner)
    profiles = [c.profile_run for c in classes]

    def windowed(fn: Callable[..., Any], into: list, name: Callable[..., str]) -> Callable[..., Any]:
        def inner(*args: Any, **kwargs: Any) -> Any:
            open_window()
            try:
                return fn(*args, **kwargs)
            finally:
                into.append({"name": name(*args), **close_window()})
                stop()  # nothing recorded between windows (graph capture, compilation)

        return inner

    probes.run_batch = windowed(run_batch, found["worst_batches"], lambda _runner, batch: batch.name)
    for cls, original in zip(classes, profiles):
        cls.profile_run = windowed(original, found["profile_runs"], lambda *_a: "profile_run")
    try:
        yield
    finally:
        probes.run_batch = run_batch
        for cls, original in zip(classes, profiles):
            cls.profile_run = original
