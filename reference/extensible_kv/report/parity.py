"""Greedy parity of each non-legacy run in the report: the legacy runs of the same case (its determinism control)
against it, through ``extensible_kv.parity``, with the batch-invariant pair where one was run."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..parity import Verdict, classify_with_fallback
from .run import Case


@dataclass(frozen=True)
class ParityRow:
    case: Case
    legacy: list[Case]  # the baseline's runs (without batch invariance), first run first
    verdict: Verdict


def _invariant(case: Case) -> bool:
    return bool(getattr(case.spec, "batch_invariant", False))


def parity_rows(cases: list[Case]) -> list[ParityRow]:
    """One row per uncorrupted non-legacy run outside batch-invariant mode, in path order."""
    by_case: dict[tuple, list[Case]] = defaultdict(list)
    for c in sorted(cases, key=lambda c: c.run_order):
        by_case[c.same_case].append(c)
    rows = []
    for c in sorted(cases, key=lambda c: c.path):
        if c.mode == "legacy" or c.corrupt or _invariant(c):
            continue
        same = [x for x in by_case[c.same_case] if not x.corrupt]
        legacy = [x for x in same if x.mode == "legacy" and not _invariant(x)]
        legacy_bi = [x.data.model_dump(by_alias=True) for x in same if x.mode == "legacy" and _invariant(x)]
        ext_bi = [x.data.model_dump(by_alias=True) for x in same if x.mode == c.mode and _invariant(x)]
        verdict = classify_with_fallback({"legacy": [x.data.model_dump(by_alias=True) for x in legacy],
                                          "extensible": c.data.model_dump(by_alias=True),
                                          "legacy_bi": legacy_bi, "extensible_bi": ext_bi[0] if ext_bi else None})
        rows.append(ParityRow(c, legacy, verdict))
    return rows
