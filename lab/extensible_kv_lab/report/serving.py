"""The serving-speed pairs of a run (``serving-*.json``): decode throughput and engine start, extensible against
legacy at the same block count, as the report and summary.json show them."""

from __future__ import annotations

from .run import Source


def start_state(compiled: bool | None) -> str:
    return "compile cache not recorded" if compiled is None else "compiled" if compiled else "loaded the compile cache"


def serving_rows(sources: list[Source]) -> list[dict]:
    """One row per file: each mode's decode tokens/s and start seconds, the ratios, whether the decode target is met
    and whether the start ratio compares like with like (Note [A start time needs the same compile cache] in
    ``integration/parity.py``)."""
    rows = []
    for s in sources:
        legacy, ext, r = s.data.mode("legacy"), s.data.mode("extensible"), s.data.ratio
        either = legacy or ext
        states = [start_state(m.compiled if m else None) for m in (legacy, ext)]
        apart = f"legacy {states[0]}, extensible {states[1]}"
        note = f"both {states[0]}" if states[0] == states[1] else apart
        if not r.engine_seconds_comparable:
            note = start_state(None) if r.engine_seconds_comparable is None else f"not comparable: {apart}"
        rows.append(
            {
                "source": s.source,
                "model": either and either.model,
                "runner": either and either.runner,
                "legacy": legacy,
                "extensible": ext,
                "ratio": r,
                "windows": len(r.decode_window_ratios) if r.decode_window_ratios else None,
                "met": r.decode_tokens_per_s >= r.target_decode,
                "start_ratio": r.engine_seconds if r.engine_seconds_comparable else None,
                "start_note": note,
            }
        )
    return rows
