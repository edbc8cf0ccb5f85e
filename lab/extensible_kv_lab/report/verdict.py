"""Whether the extensible KV cache is safe to turn on, for a run and for each of its cases and serving pairs: four
checks against thresholds stated once, here. A check without data is unknown and says what was not measured (``line``).

The tokens check reads the greedy parity of each non-legacy run (``parity_rows``): the legacy runs of the same case
(its determinism control) against it, through ``extensible_kv_lab.parity``, with the batch-invariant pair where one ran.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..parity import Verdict, classify_with_fallback
from .accounting import MemoryBreakdown
from .numbers import MIB, number
from .run import Case, Run

BUDGET_TOLERANCE = 16 * MIB  # the most memory beyond gpu_memory_utilization at the measured peak
DECODE_RATIO = 0.99  # the least decode tokens/s of extensible over legacy, at the same block count


@dataclass(frozen=True)
class ParityRow:
    case: Case
    legacy: list[Case]  # the baseline's runs (without batch invariance), first run first
    verdict: Verdict


def _dump(case: Case) -> dict:
    return case.data.model_dump(by_alias=True)


def parity_rows(cases: list[Case]) -> list[ParityRow]:
    """One row per uncorrupted non-legacy run outside batch-invariant mode, in path order."""
    rows = []
    for c in sorted(cases, key=lambda c: c.path):
        if c.mode == "legacy" or c.corrupt or c.batch_invariant:
            continue
        same = sorted((x for x in cases if x.same_case == c.same_case and not x.corrupt), key=lambda x: x.run_order)
        legacy = [x for x in same if x.mode == "legacy" and not x.batch_invariant]
        runs = {"legacy": [_dump(x) for x in legacy], "extensible": _dump(c)}
        runs["legacy_bi"] = [_dump(x) for x in same if x.mode == "legacy" and x.batch_invariant]
        runs["extensible_bi"] = next((_dump(x) for x in same if x.mode == c.mode and x.batch_invariant), None)
        rows.append(ParityRow(c, legacy, classify_with_fallback(runs)))
    return rows


@dataclass(frozen=True)
class Check:
    kind: str  # rules, tokens, budget or decode
    ok: bool | None  # None: not measured
    detail: str


MARKS = {True: "\u2713 pass", False: "\u2717 fail", None: "? unknown"}  # text: alike in Markdown, HTML, a terminal


def state(checks: tuple[Check, ...]) -> bool | None:
    """False where a check failed, else None where one is unknown (or there is none), else True."""
    oks = [c.ok for c in checks]
    return False if False in oks else None if None in oks or not oks else True


def mark(checks: tuple[Check, ...]) -> str:
    return MARKS[state(checks)]


def gist(checks: tuple[Check, ...]) -> str:
    """A family's checks in one cell: the first that decides its state (and how many more), or how many pass."""
    if len(checks) == 1 or state(checks):
        return checks[0].detail if len(checks) == 1 else f"{len(checks)} of {len(checks)} checks pass"
    hits = [c.detail for c in checks if c.ok is state(checks)]
    return hits[0] + (f" and {len(hits) - 1} more" if len(hits) > 1 else "")


def families(
    checks: tuple[Check, ...], subjects: dict[str, tuple[Check, ...]], parity: list[ParityRow], serving: list[dict]
) -> list[tuple[str, tuple[Check, ...]]]:
    """The run's case families and their checks: conformance, the vLLM cases of each model, serving speed. A family
    without data has the run's check that says so."""
    kind = {k: tuple(c for c in checks if c.kind == k) for k in ("rules", "tokens", "decode")}
    models: dict[str, list[Check]] = {}
    for row in parity:
        models.setdefault(row.case.spec.model, []).extend(subjects[row.case.path])
    cases = [(model, tuple(found)) for model, found in sorted(models.items())] or [("vLLM cases", kind["tokens"])]
    decode = tuple(c for row in serving for c in subjects[row["source"]]) or kind["decode"]
    return [("conformance", kind["rules"]), *cases, ("serving speed", decode)]


def line(checks: tuple[Check, ...]) -> str:
    """The verdict of ``checks``: "no" and the checks that failed, else "unknown" and those without data, else yes."""
    for word, ok in (("no", False), ("unknown", None)):
        if found := [c.detail for c in checks if c.ok is ok]:
            return f"safe to turn on: {word}: " + "; ".join(found)
    return "safe to turn on: yes"


def rules(run: Run) -> Check:
    """Every conformance test passed or was skipped, and every conformance run exited 0."""
    if not run.conformance:
        return Check("rules", None, "conformance not measured (no conformance-*.json)")
    tests = [t for c in run.conformance for t in c.data.tests]
    failed = [t for t in tests if t.outcome not in ("passed", "skipped")]
    passed = [t for t in tests if t.outcome == "passed"]
    crashed = [f"{c.source} exited {c.data.exitstatus}" for c in run.conformance if c.data.exitstatus not in (0, None)]
    if failed:
        why = f"{len(failed)} of {len(tests)} conformance tests failed (first: {failed[0].test} on {failed[0].driver})"
        return Check("rules", False, why)
    if crashed:
        return Check("rules", False, "the conformance run failed: " + ", ".join(crashed))
    return Check("rules", True if passed else None, f"{len(passed)} of {len(tests)} conformance tests passed")


def tokens(row: ParityRow) -> Check:
    v = row.verdict
    if v.tokens_identical is False:
        return Check("tokens", False, f"greedy tokens differ from legacy ({v.detail})")
    if v.tokens_identical and v.baseline_deterministic is not None:  # False: the batch-invariant pair is identical
        return Check("tokens", True, "greedy tokens identical to a deterministic baseline")
    why = "one legacy run: its determinism is not measured"
    if not v.tokens_identical:
        why = v.outcome + (f": {v.detail}" if v.detail else "")
    return Check("tokens", None, f"tokens not compared with a deterministic baseline ({why})")


def budget(b: MemoryBreakdown | None) -> Check | None:
    """``None`` for a run at a fixed block count: the extensible path did not size it."""
    if b is not None and b.case.fixed_blocks is not None:
        return None
    if (over := b and b.over_budget_at_peak) is None:
        return Check("budget", None, "memory at the measured peak not measured")
    shown = f"{number(over, 'MiB', True)} MiB beyond the budget at the measured peak"
    ok = over <= BUDGET_TOLERANCE
    return Check("budget", ok, shown if ok else f"{shown} (more than {BUDGET_TOLERANCE // MIB} MiB)")


def decode(row: dict) -> Check:
    ratio = row["ratio"].decode_tokens_per_s
    ok, shown = ratio >= DECODE_RATIO, f"decode extensible / legacy {number(ratio, 'ratio')}"
    return Check("decode", ok, shown if ok else f"{shown} is below {DECODE_RATIO}")


def judge(
    run: Run, breakdowns: list[MemoryBreakdown], parity: list[ParityRow], serving: list[dict]
) -> tuple[tuple[Check, ...], dict[str, tuple[Check, ...]]]:
    """The run's checks and each subject's: every non-legacy case of the parity table (by path) and every serving
    pair (by file). Where subjects fail or lack a check, the run's names the first of them."""
    by_case = {id(b.case): b for b in breakdowns}
    subjects = {
        row.case.path: tuple(c for c in (tokens(row), budget(by_case.get(id(row.case)))) if c) for row in parity
    } | {row["source"]: (decode(row),) for row in serving}
    checks = [rules(run)]
    checks += [] if parity else [Check("tokens", None, "vLLM cases not measured (no non-legacy run in integration/)")]
    checks += [] if serving else [Check("decode", None, "decode extensible / legacy not measured (no serving-*.json)")]
    for kind in ("tokens", "budget", "decode"):
        judged = [(name, c) for name, cs in subjects.items() for c in cs if c.kind == kind]
        for ok in (False, None):
            if hits := [(name, c) for name, c in judged if c.ok is ok]:
                more = f" and {len(hits) - 1} more" if len(hits) > 1 else ""
                checks.append(Check(kind, ok, f"{hits[0][1].detail} in {hits[0][0]}{more}"))
        if judged and all(c.ok for _, c in judged):
            checks.append(Check(kind, True, f"{len(judged)} of {len(judged)} pass"))
    return tuple(checks), subjects
