"""Greedy parity outcomes: legacy runs of a vLLM case against an extensible run, with the determinism control.

A case's legacy baseline runs twice; if the two disagree the outcome is ``baseline nondeterministic`` with their first
difference, and the token verdict comes from the same comparison in vLLM's batch-invariant mode where it was run
(``classify_with_fallback``). Runs are the case files ``integration/run_case.py`` writes (``measurements.
IntegrationCase``) as dicts, or ``{"error": ...}`` for a run that failed. Used by ``integration/parity.py`` while the
matrix runs and by the report when it renders a run folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

IDENTICAL, DIFFERS, NONDETERMINISTIC = "identical", "differs", "baseline nondeterministic"
REFUSED, EXTENSIBLE_REFUSED, NOT_RUN, FAILED = "refused", "extensible refused", "not run", "failed"


def first_difference(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> str | None:
    """Where two runs' token ids first differ (``None``: equal)."""
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} prompts"
    for i, (x, y) in enumerate(zip(a, b)):
        if list(x) != list(y):
            x, y = list(x), list(y)
            j = next(k for k, (p, q) in enumerate(zip(x + [None], y + [None])) if p != q)
            return f"prompt {i} first differs at token {j}: {x[j : j + 4]} vs {y[j : j + 4]}"
    return None


@dataclass(frozen=True)
class Verdict:
    outcome: str  # IDENTICAL, DIFFERS, NONDETERMINISTIC, REFUSED, EXTENSIBLE_REFUSED, NOT_RUN, FAILED
    detail: str = ""
    baseline_deterministic: bool | None = None
    tokens_identical: bool | None = None


def _problem(run: dict | None) -> Verdict | None:
    if run is None:
        return Verdict(NOT_RUN)
    if "error" in run:
        return Verdict(FAILED, run["error"])
    return None


def refusal(run: dict | None) -> str | None:
    """vLLM's (or the extensible path's) reason for refusing the run's engine; ``None`` for a run that built one. A
    run file always has the ``refused`` field (``null`` when the engine was built): test its value, not its key."""
    return (run or {}).get("refused") or None


def classify(legacy: Sequence[dict | None], ext: dict | None) -> Verdict:
    """The outcome of one comparison: legacy runs (two establish the baseline's determinism) against one extensible
    run."""
    if not legacy:
        return Verdict(NOT_RUN)
    for run in legacy:
        if (bad := _problem(run)) is not None:
            return replace(bad, detail=f"legacy: {bad.detail}" if bad.detail else "")
        if reason := refusal(run):
            return Verdict(REFUSED, reason)
    deterministic = None
    if len(legacy) >= 2:
        diff = first_difference(legacy[0]["token_ids"], legacy[1]["token_ids"])
        if diff is not None:
            return Verdict(NONDETERMINISTIC, f"legacy runs disagree: {diff}", False)
        deterministic = True
    if (bad := _problem(ext)) is not None:
        return replace(
            bad, baseline_deterministic=deterministic, detail=f"extensible: {bad.detail}" if bad.detail else ""
        )
    if reason := refusal(ext):
        return Verdict(EXTENSIBLE_REFUSED, reason, deterministic)
    diff = first_difference(ext["token_ids"], legacy[0]["token_ids"])
    if diff is None:
        return Verdict(IDENTICAL, "", deterministic, True)
    return Verdict(DIFFERS, f"extensible vs legacy: {diff}", deterministic, False)


def classify_with_fallback(runs: dict) -> Verdict:
    """``classify`` of the case's runs; a nondeterministic baseline names the comparison in batch-invariant mode
    (``runs['legacy_bi']``, ``runs['extensible_bi']``) in its detail and takes its token verdict from there."""
    verdict = classify(runs.get("legacy") or [], runs.get("extensible"))
    if verdict.outcome != NONDETERMINISTIC:
        return verdict
    bi = classify(runs.get("legacy_bi") or [], runs.get("extensible_bi"))
    detail = f"{verdict.detail}; batch-invariant mode: {bi.outcome}" + (f" ({bi.detail})" if bi.detail else "")
    return replace(verdict, detail=detail, tokens_identical=bi.tokens_identical)
