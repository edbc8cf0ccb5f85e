"""Greedy parity of the extensible KV cache against legacy vLLM 0.26.0, with a determinism control and the memory
budget at a measured peak: the logic, runnable and testable without a GPU. The GPU work happens in
``integration/run_case.py`` processes, one per engine, started from here (``run_subprocess``).

A parity case (``Case``) runs, each in a fresh process:

1. legacy twice: the baseline must agree with itself (``classify``). If it does not, the outcome is
   ``baseline nondeterministic`` with the two legacy outputs' first difference, and the comparison is repeated in
   vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``; refused combinations say vLLM's reason), never a silent
   pass or a flaky failure;
2. extensible: its tokens against the baseline's (``identical`` / ``differs``), its measured peak against the budget
   (``check_memory_budget``), and its sensitivity run (the same pass after every committed KV block was overwritten
   must change the tokens).

Note [Over budget at the measured peak]
    The one definition, used by ``run_case`` (``memory.peak``) and by the checks here. vLLM 0.26.0 gives an engine
    ``requested = ceil(gpu_memory_utilization x total)`` bytes (``vllm.v1.worker.utils.request_memory``,
    ``worker.requested_memory``) counted from the worker's start: at its ``init_snapshot`` the device had
    ``init_free`` bytes free, and the engine must leave ``init_free - requested`` of them free (``unrequested_memory``
    in ``Worker.determine_available_memory``). So, at the peak:

        used_at_peak          = init_free - free_at_peak       (device memory used since the worker started)
        over_budget_measured  = used_at_peak - requested        (> 0: over the budget; < 0: that much left unused)

    ``free_at_peak`` is the free figure of ``torch.cuda.mem_get_info()``, read after a device synchronize once the
    peak-shaped batch has run (``max_num_batched_tokens`` prompt tokens over ``max_num_seqs`` sequences,
    ``max_tokens=1``, after the final commit and the measured generation), less what torch reserved during the batch
    and released before the reading (``max_memory_reserved() - memory_reserved()``; 0 unless the allocator emptied
    its cache). torch's caching allocator keeps what the batch reserved, so this reading sees the batch's peak. It
    counts everything: weights, KV cache, CUDA graph pools, activations, workspaces, kernels loaded lazily, NCCL.
    The extensible run passes at ``over_budget_measured <= BUDGET_TOLERANCE`` (16 MiB: allocations made after the
    final commit that no sizing sees, e.g. small workspaces of the first real steps); legacy's figure is reported
    beside it, and bounds how many fewer blocks the extensible run may commit.

    ``peak_figures`` also splits the bytes gained since the final commit into torch's reserved growth, non-torch
    growth (CUDA context, lazily loaded kernels, cuBLAS/NCCL) and KV growth, each before and during the batch: the
    terms a sizing must foresee.

    A case with speculative decoding (``run_case --speculative ngram:K``) has a second measured phase before the
    peak-shaped batch: ``max_num_seqs`` sequences decoding with every sequence proposing ``K`` drafts in every step
    (``S x (1 + K)`` logits rows through the LM head and the rejection sampler), read the same way at its end
    (``speculative_figures``, ``memory.speculative``). The case's figure, ``memory.peak.over_budget_measured``, is
    then the larger of the two phases' (``peak_figures`` takes the max: the one place every reader, the checks here
    and the report, gets it from); ``over_budget_prefill`` keeps the prefill batch's own and ``over_budget_phase``
    says which phase set it. ``used_at_peak``, ``free_at_peak`` and ``growth`` stay the prefill batch's readings.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _part in ("reference", "lab"):  # a checkout without the runtime and the lab installed (the GPU machine)
    if str(ROOT / _part) not in sys.path:
        sys.path.append(str(ROOT / _part))
from extensible_kv_lab.measurements import MeasuredPeak, start_comparable  # noqa: E402 - after the path
from extensible_kv_lab.parity import NONDETERMINISTIC, classify, classify_with_fallback, refusal  # noqa: E402

MIB = 1 << 20
BUDGET_TOLERANCE = 16 * MIB  # allocations made after the final commit (sampler warmup, small workspaces)
CACHED_BLOCKS = 2  # the measured pass must read cached KV blocks: each prompt's first two (run_case.prompt_len)


# -- the measured peak ---------------------------------------------------------------------------------------------
def over_budget_measured(init_free: int, free_at_peak: int, requested: int) -> int:
    """Device memory used since the worker started, minus the budget (Note [Over budget at the measured peak])."""
    return (init_free - free_at_peak) - requested


def free_at_phase_peak(free_after: int, torch_max_reserved: int, torch_reserved_after: int) -> tuple[int, int]:
    """(free memory at a measured phase's peak, what torch reserved during the phase and released before the
    reading): the free reading after the phase less what torch gave back (Note [Over budget at the measured
    peak])."""
    released = max(0, torch_max_reserved - torch_reserved_after)
    return free_after - released, released


def peak_figures(after_warmup: dict, peak: dict, speculative: dict | None = None) -> dict:
    """``memory.peak`` of a case: the readings of ``run_case``'s peak-shaped batch (``peak``) with the figures after
    the final commit (``after_warmup``: ``memory`` of the case), and what follows from them (Note [Over budget at
    the measured peak]). With ``speculative`` (``memory.speculative``, ``speculative_figures``) the case's
    ``over_budget_measured`` is the larger of the two phases'."""
    free_at_peak, released = free_at_phase_peak(
        peak["free_after_batch"], peak["torch_max_reserved"], peak["torch_reserved_after"]
    )
    init_free, requested = after_warmup["init_free"], after_warmup["requested"]
    phases = {"prefill": over_budget_measured(init_free, free_at_peak, requested)}
    if speculative and speculative.get("over_budget_measured") is not None:
        phases["speculative"] = speculative["over_budget_measured"]
    phase = max(phases, key=phases.__getitem__)  # prefill on a tie
    used = init_free - free_at_peak
    kv_warm = after_warmup.get("kv_backed_after_warmup") or 0
    non_torch_warm = (init_free - after_warmup["free_after_warmup"]) - after_warmup["torch_reserved"] - kv_warm
    before = peak["before_batch"]
    non_torch_before = (init_free - before["free"]) - before["torch_reserved"] - before["kv_backed"]
    non_torch_peak = used - peak["torch_max_reserved"] - peak["kv_backed"]
    batch = peak["batch"]
    steps = batch.get("step_tokens") or []
    shaped = (
        batch["prompt_tokens"] == batch["max_num_batched_tokens"]
        and batch["num_seqs"] == batch["max_num_seqs"]
        and max(steps, default=0) == batch["max_num_batched_tokens"]
    )
    return {
        **peak,
        "init_free": init_free,
        "requested": requested,
        "total": after_warmup.get("total"),
        "reserved_released": released,
        "free_at_peak": free_at_peak,
        "used_at_peak": used,
        "over_budget_measured": phases[phase],
        "over_budget_prefill": phases["prefill"],
        "over_budget_phase": phase,
        "non_torch_at_peak": non_torch_peak,
        "peak_shaped": shaped,
        # Growth since the final commit: before the batch (the generation passes, the harness) and during it.
        "growth": {
            "before_batch": {
                "torch_reserved": before["torch_reserved"] - after_warmup["torch_reserved"],
                "non_torch": non_torch_before - non_torch_warm,
                "kv": before["kv_backed"] - kv_warm,
            },
            "during_batch": {
                "torch_reserved": peak["torch_max_reserved"] - before["torch_reserved"],
                "non_torch": non_torch_peak - non_torch_before,
                "kv": peak["kv_backed"] - before["kv_backed"],
            },
        },
    }


def speculative_figures(after_warmup: dict, readings: dict) -> dict:
    """``memory.speculative`` of a case: ``run_case``'s widest-speculative-step phase (``readings``: ``k``,
    ``method``, ``requests``, ``vocab``, the torch and free-memory readings before and after it, and every step's
    ``[scheduled tokens, requests with drafts, draft tokens]``) with the figures after the final commit, read like
    the peak (Note [Over budget at the measured peak]). ``widest_steps``: the steps in which all ``requests``
    proposed ``k`` drafts each (``rows`` logits rows); a phase without one measured nothing wide."""
    k, requests = readings["k"], readings["requests"]
    rows = requests * (1 + k)  # each request's drafts plus its bonus token
    before = readings["before"]
    free_at_end, released = free_at_phase_peak(
        readings["free_after"], readings["torch_max_reserved"], readings["torch_reserved_after"]
    )
    steps = readings.get("steps") or []
    return {
        "k": k,
        "method": readings["method"],
        "requests": requests,
        "rows": rows,
        "vocab": readings["vocab"],
        "step_peak_allocated": readings["torch_max_allocated"] - before["torch_allocated"],
        "step_reserved_growth": readings["torch_max_reserved"] - before["torch_reserved"],
        "over_budget_measured": over_budget_measured(after_warmup["init_free"], free_at_end, after_warmup["requested"]),
        "free_at_end": free_at_end,
        "reserved_released": released,
        "widest_steps": sum(
            1 for tokens, reqs, drafts in steps if reqs == requests and drafts == requests * k and tokens == rows
        ),
        "steps": steps,
        "max_tokens": readings.get("max_tokens"),
        "seconds": readings.get("seconds"),
        "before": before,
    }


def phase_problems(run: dict, mode: str) -> list[str]:
    """What a run's own phases failed to reach (empty: nothing): a speculative case must have measured at least one
    step at its widest, a multimodal case must have held its encoder cache full at the measured peak."""
    memory = run.get("memory") or {}
    problems = []
    spec = memory.get("speculative")
    if spec is not None and not spec.get("widest_steps"):
        problems.append(
            f"{mode} speculative phase never ran its widest step: expected {spec['requests']} requests "
            f"x {spec['k']} drafts ({spec['rows']} rows) in one step, got steps "
            f"[tokens, requests, drafts] {spec.get('steps')}"
        )
    enc = memory.get("encoder_cache")
    if enc is not None and enc.get("capacity_items") and enc.get("items_at_peak") != enc["capacity_items"]:
        problems.append(
            f"{mode} encoder cache held {enc.get('items_at_peak')} items at the measured peak, expected "
            f"it full ({enc['capacity_items']} items of {enc.get('bytes_per_item')} bytes)"
        )
    return problems


def budget_terms(case: dict) -> dict | None:
    """What the extensible sizing foresaw after warmup against what the case then took, in bytes; ``None`` without a
    measured peak. ``predicted_torch_growth`` is the sizing's activation growth still to come
    (``extensible.measured.torch_growth``; legacy: its profiled peak, all of which it set aside);
    ``served_allocated`` the sizing's served batch's allocated peak (``None`` where not measured) against
    ``batch_allocated``, the peak batch's (Note [A served batch's query length] in ``extensible_kv.vllm.sizing``)."""
    memory = case.get("memory") or {}
    peak = memory.get("peak")
    if not peak:
        return None
    measured = (case.get("extensible") or {}).get("measured") or {}
    grown = MeasuredPeak.model_validate(peak).grown
    predicted = measured.get("torch_growth", memory.get("profiled_peak_activation"))
    return {
        "over_budget_measured": peak["over_budget_measured"],
        "torch_growth": grown("torch_reserved"),
        "predicted_torch_growth": predicted,
        "non_torch_growth": grown("non_torch"),
        "kv_growth": grown("kv"),
        "budget_left_after_warmup": (memory["free_after_warmup"] - (memory["init_free"] - memory["requested"])),
        "served_allocated": measured.get("served_allocated"),
        "batch_allocated": (
            peak["torch_max_allocated"] - peak["before_batch"]["torch_allocated"]
            if "torch_max_allocated" in peak
            else None
        ),
    }


def check_memory_budget(legacy: dict, ext: dict, tolerance: int = BUDGET_TOLERANCE) -> list[str]:
    """Problems with the extensible run's memory, at its measured peak (empty: none): it stays inside
    gpu_memory_utilization's budget (within ``tolerance``), its peak batch was peak-shaped, and it commits as many
    blocks as legacy except where legacy itself went over the budget: any shortfall is at most legacy's overshoot."""
    problems = []
    ep, lp = ext["memory"].get("peak"), legacy["memory"].get("peak")
    if not ep or not lp:
        return [f"no measured peak ({'extensible' if not ep else 'legacy'} run ran without --peak)"]
    for mode, p in (("extensible", ep), ("legacy", lp)):
        if not p["peak_shaped"]:
            b = p["batch"]
            problems.append(
                f"{mode} peak batch was not peak-shaped: {b['prompt_tokens']} prompt tokens over "
                f"{b['num_seqs']} sequences, at most {max(b.get('step_tokens') or [0])} in a step; "
                f"expected {b['max_num_batched_tokens']} over {b['max_num_seqs']} in one step"
            )
    ext_over, legacy_over = ep["over_budget_measured"], lp["over_budget_measured"]
    if ext_over > tolerance:
        problems.append(
            f"extensible run used {ext_over / MIB:.1f} MiB more than gpu_memory_utilization allows at "
            f"its measured peak (legacy: {legacy_over / MIB:.1f} MiB; tolerance {tolerance / MIB:.0f} MiB)"
        )
    measured = (ext.get("extensible") or {}).get("measured") or {}
    if not measured:
        return problems + ["the extensible run reports no measurement (extensible.measured)"]
    lb, eb = legacy["memory"]["num_gpu_blocks"], ext["memory"]["num_gpu_blocks"]
    shortfall = (lb - eb) * measured["bytes_per_block"]
    if shortfall > max(0, legacy_over) + measured["rounding_bound"] + tolerance:
        problems.append(
            f"extensible committed {eb} blocks, legacy {lb}: a shortfall of {shortfall / MIB:.1f} MiB, "
            f"more than legacy's own overshoot of its budget at its measured peak "
            f"({legacy_over / MIB:.1f} MiB)"
        )
    return problems


# -- cases ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One parity case: a model and configuration, run legacy (``baseline_runs`` times) and extensible."""

    model: str
    runner: str
    backend: str = "FLASH_ATTN"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_model_len: int = 256
    max_num_seqs: int = 8
    capture_sizes: str = "1,2,4,8"
    max_num_batched_tokens: int | None = None
    expect_cached: bool = True
    baseline_runs: int = 2
    seconds: int = 60  # a run's expected wall time (engine start included)
    timeout: int = 300
    extra: tuple[str, ...] = ()
    group: str = ""
    speculative: str | None = None  # run_case --speculative, e.g. "ngram:4"
    variant: str = ""  # ends the id where cases differ otherwise only in figures the id leaves out (e.g. "s64")

    @property
    def kv_name(self) -> str:
        return "bf16" if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def id(self) -> str:
        spec = f"-{self.speculative.replace(':', '')}" if self.speculative else ""
        variant = f"-{self.variant}" if self.variant else ""
        return f"{self.model}-{self.runner}-{self.backend}-{self.kv_name}-b{self.block_size}{spec}{variant}"

    @property
    def label(self) -> str:
        """The model column of the table: the model, with the speculative method and sequence count where set."""
        extras = ([self.speculative] if self.speculative else []) + (
            [f"{self.max_num_seqs} seqs"] if self.variant else []
        )
        return self.model + (f" ({', '.join(extras)})" if extras else "")

    def args(self, mode: str, *, batch_invariant: bool = False) -> list[str]:
        args = [
            "--model",
            self.model,
            "--runner",
            self.runner,
            "--backend",
            self.backend,
            "--mode",
            mode,
            "--kv-cache-dtype",
            self.kv_cache_dtype,
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--capture-sizes",
            self.capture_sizes,
        ]
        if self.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.speculative:
            args += ["--speculative", self.speculative]
        if batch_invariant:
            args.append("--batch-invariant")
        return args + list(self.extra)

    def run_name(self, mode: str, repeat: int = 0, batch_invariant: bool = False) -> str:
        return f"{self.id}-{mode}" + ("-bi" if batch_invariant else "") + (f"-r{repeat + 1}" if repeat else "")


# A run: (name, run_case arguments, timeout, whether the time budget cut the timeout below the case's own) -> the
# case JSON, {"error": ...}, or None (not run).
Runner = Callable[[str, list[str], int, bool], "dict | None"]


def run_subprocess(
    out_dir: Path, name: str, args: list[str], timeout: int, *, budget_cut: bool = False, retry_failed: bool = False
) -> dict | None:
    """One ``run_case`` process writing ``out_dir/name.json`` (its output in ``name.log``). Resumable: an existing
    JSON is read, not rerun; a run that failed before (``name.error.txt``) is not rerun unless ``retry_failed``. A
    run stopped by a timeout the time budget cut short (``budget_cut``) did not fail: it returns ``None`` (not run)."""
    out, log, err = out_dir / f"{name}.json", out_dir / f"{name}.log", out_dir / f"{name}.error.txt"
    if out.exists():
        try:
            return json.loads(out.read_text())
        except ValueError:
            out.unlink()  # cut short by a killed call: run it again
    if err.exists() and not retry_failed:
        return {"error": err.read_text().strip()}
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT / "reference"), str(ROOT / "lab"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
        PYTHONUNBUFFERED="1",
    )
    cmd = [sys.executable, "-m", "integration.run_case", *args, "--out", str(out)]
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.monotonic() - start
    if rc == 0 and out.exists():
        return json.loads(out.read_text())
    if rc is None and budget_cut:
        return None
    tail = log.read_text()[-1500:].strip().splitlines()
    reason = (f"timed out after {timeout} s" if rc is None else f"exit {rc} after {seconds:.0f} s") + (
        f": {tail[-1]}" if tail else ""
    )
    err.write_text(reason + "\n")
    return {"error": reason}


def run_parity(case: Case, runner: Runner, *, budget: Callable[[int], int | None] = lambda s: s) -> dict:
    """Run a case's processes (legacy ``case.baseline_runs`` times, then extensible; the batch-invariant pair and
    extensible run when the baseline is nondeterministic) through ``runner``. ``budget(seconds)`` gives the timeout
    a run may take now, or ``None`` when no time is left (the run is skipped: resumable). Returns the runs by role."""
    runs: dict = {"legacy": [], "extensible": None, "legacy_bi": [], "extensible_bi": None}

    def one(mode: str, repeat: int = 0, bi: bool = False) -> dict | None:
        timeout = budget(case.seconds)
        if timeout is None:
            return None
        return runner(
            case.run_name(mode, repeat, bi),
            case.args(mode, batch_invariant=bi),
            min(timeout, case.timeout),
            timeout < case.timeout,
        )

    for repeat in range(case.baseline_runs):
        runs["legacy"].append(one("legacy", repeat))
        if runs["legacy"][-1] is None or refusal(runs["legacy"][-1]):
            break
    if any(map(refusal, runs["legacy"])):
        return runs  # vLLM refuses the combination: nothing to compare
    runs["extensible"] = one("extensible")
    if classify(runs["legacy"], runs["extensible"]).outcome == NONDETERMINISTIC:
        for repeat in range(2):
            runs["legacy_bi"].append(one("legacy", repeat, bi=True))
            if runs["legacy_bi"][-1] is None or refusal(runs["legacy_bi"][-1]):
                break
        if not any(map(refusal, runs["legacy_bi"])):
            runs["extensible_bi"] = one("extensible", bi=True)
    return runs


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:+.1f}"


def row(case: Case, runs: dict) -> dict:
    """The table row of one case."""
    verdict = classify_with_fallback(runs)
    legacy = next((r for r in runs.get("legacy") or [] if r and r.get("memory")), None)
    ext = runs.get("extensible") if (runs.get("extensible") or {}).get("memory") else None
    problems: list[str] = []
    if legacy and ext:
        problems = (
            check_memory_budget(legacy, ext) + phase_problems(legacy, "legacy") + phase_problems(ext, "extensible")
        )
        cached = ext.get("num_cached_tokens") or []
        if case.expect_cached and not all(c and c >= CACHED_BLOCKS * case.block_size for c in cached):
            problems.append(
                f"the measured pass must read {CACHED_BLOCKS} cached KV blocks per prompt "
                f"({CACHED_BLOCKS * case.block_size} tokens), got {cached}"
            )
    sens = (ext or {}).get("sensitivity")
    over = lambda r: (((r or {}).get("memory") or {}).get("peak") or {}).get("over_budget_measured")  # noqa: E731
    memory = (ext or legacy or {}).get("memory") or {}
    return {
        "case": case.id,
        "model": case.model,
        "label": case.label,
        "runner": case.runner,
        "backend": case.backend,
        "kv_dtype": case.kv_name,
        "block_size": case.block_size,
        "legacy_blocks": (legacy or {}).get("memory", {}).get("num_gpu_blocks"),
        "extensible_blocks": (ext or {}).get("memory", {}).get("num_gpu_blocks"),
        "outcome": verdict.outcome,
        "detail": verdict.detail,
        "baseline_deterministic": verdict.baseline_deterministic,
        "tokens_identical": verdict.tokens_identical,
        "over_budget_legacy": over(legacy),
        "over_budget_extensible": over(ext),
        "sensitivity_proven": None if not sens else bool(sens["changed"]),
        "budget_problems": problems,
        "terms": budget_terms(ext) if ext else None,
        "legacy_terms": budget_terms(legacy) if legacy else None,
        "speculative": memory.get("speculative"),
        "encoder_cache": memory.get("encoder_cache"),
    }


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


TABLE_HEADER = (
    "model",
    "runner",
    "backend",
    "KV dtype",
    "block",
    "legacy blocks",
    "ext blocks",
    "baseline deterministic?",
    "tokens identical?",
    "over budget MiB legacy / ext",
    "sensitivity proven?",
    "outcome",
)


def table(rows: Sequence[dict]) -> str:
    """The per-case table (markdown), then one line per case with a detail or a budget problem."""
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    notes = []
    for r in rows:
        budget = f"{_mib(r['over_budget_legacy'])} / {_mib(r['over_budget_extensible'])}"
        outcome = r["outcome"] + (" (budget!)" if r["budget_problems"] else "")
        lines.append(
            "| "
            + " | ".join(
                str(v)
                for v in (
                    r.get("label") or r["model"],
                    r["runner"],
                    r["backend"],
                    r["kv_dtype"],
                    r["block_size"],
                    r["legacy_blocks"] or "-",
                    r["extensible_blocks"] or "-",
                    _yes(r["baseline_deterministic"]),
                    _yes(r["tokens_identical"]),
                    budget,
                    _yes(r["sensitivity_proven"]),
                    outcome,
                )
            )
            + " |"
        )
        for text in ([r["detail"]] if r["detail"] else []) + r["budget_problems"]:
            notes.append(f"- {r['case']}: {text}")
        t = r.get("terms")
        if t:
            notes.append(
                f"- {r['case']}: since the final commit the extensible run grew torch by "
                f"{t['torch_growth'] / MIB:.1f} MiB (sizing foresaw "
                f"{(t['predicted_torch_growth'] or 0) / MIB:.1f}), non-torch by "
                f"{t['non_torch_growth'] / MIB:.1f} MiB, KV by {t['kv_growth'] / MIB:.1f} MiB"
                + (
                    ""
                    if t["served_allocated"] is None or t["batch_allocated"] is None
                    else f"; the sizing's served batch allocated {t['served_allocated'] / MIB:.1f} MiB at its "
                    f"peak, the peak batch {t['batch_allocated'] / MIB:.1f} MiB"
                )
            )
        notes += [f"- {r['case']}: {text}" for text in phase_lines(r)]
    return "\n".join(lines + ([""] + notes if notes else []))


def phase_lines(r: dict) -> list[str]:
    """The table's notes on a row's speculative phase and encoder cache (the extensible run's, else legacy's)."""
    lines = []
    if spec := r.get("speculative"):
        lines.append(
            f"widest speculative step ({spec['method']}, {spec['requests']} requests x (1 + {spec['k']}) = "
            f"{spec['rows']} rows x {spec['vocab']} vocab, {spec.get('widest_steps')} such steps): torch "
            f"allocated +{spec['step_peak_allocated'] / MIB:.1f} MiB, reserved "
            f"+{spec['step_reserved_growth'] / MIB:.1f} MiB, {_mib(spec['over_budget_measured'])} MiB over "
            f"budget at its end"
        )
    if enc := r.get("encoder_cache"):
        per = enc.get("bytes_per_item") or 0
        lines.append(
            f"encoder cache: {(enc.get('held_bytes') or 0) / MIB:.1f} MiB held at most "
            f"({enc.get('items_held')} items of {per / MIB:.2f} MiB; {enc.get('items_at_peak')} of "
            f"{enc.get('capacity_items')} at the measured peak), {(enc.get('profiled_bytes') or 0) / MIB:.1f} "
            f"MiB during vLLM's profile"
        )
    return lines


# -- serving throughput --------------------------------------------------------------------------------------------
def _stats(data: Sequence[float]) -> dict:
    xs = sorted(data)
    n = len(xs)
    mean = sum(xs) / n
    q = lambda f: xs[min(n - 1, int(f * (n - 1) + 0.5))]  # noqa: E731
    sd = (sum((x - mean) ** 2 for x in xs) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return {
        "min": xs[0],
        "max": xs[-1],
        "mean": mean,
        "stddev": sd,
        "rounds": n,
        "median": q(0.5),
        "iqr": q(0.75) - q(0.25),
        "q1": q(0.25),
        "q3": q(0.75),
        "iqr_outliers": 0,
        "stddev_outliers": 0,
        "outliers": "0;0",
        "ld15iqr": xs[0],
        "hd15iqr": xs[-1],
        "ops": 1 / mean if mean else 0.0,
        "total": sum(xs),
        "iterations": 1,
        "data": list(data),
    }


# Note [Decode windows are paired]
# A throughput run times ``windows`` consecutive windows of decode steps over the same sequences, so each window
# decodes at a longer context than the one before and runs slower: on the H200 (8B shape, 256 sequences, 100 steps
# a window) the five windows of one run took 1.035, 1.104, 1.194, 1.280 and 1.368 s. The median of one run's windows
# is therefore its middle window, and one slow window elsewhere (V2's legacy run: 1.263 s in its second window,
# against 1.103 s for the extensible run's) can become a run's median and move the ratio by 6%. Both runs decode
# the same prompts for the same steps, so the i-th windows are at the same context length: the ratio is taken
# window by window, extensible tokens/s over legacy tokens/s, and its median is the figure held against the target
# (0.99). The per-window ratios and their range are kept beside it.
#
# Note [A start time needs the same compile cache]
# vLLM compiles the model with torch.compile at engine start and caches the result on disk; an engine that finds
# the cache loads it instead (on the H200, 8B shape: 25.7 s compiling, 5.7 s loading). In a throughput case the
# first engine compiles and the later ones load, so a start ratio against the first engine measures the cache, not
# the KV cache (the first H200 pairs, one engine each way, read 0.43 and 0.42). Each run records how many files it
# wrote into the cache (``compile_cache_files_written``); the start ratio is taken between each mode's last run
# (both after the first engine compiled) and is shown only when both recorded the same state.
#
# Note [Legacy, extensible, extensible, legacy]
# The engines of a throughput case run one after the other on one GPU, and whatever drifts over the minutes of a
# case (clocks as the GPU warms, caches on disk) favours one order. The first H200 pairs ran legacy then extensible
# once each: V1's window ratios read 0.949 to 1.003, rising window by window. So a case runs the modes in the order
# legacy, extensible, extensible, legacy and pairs the first legacy run with the first extensible one and the second
# with the second: a drift that slows the later runs slows the extensible side of the first pair and the legacy
# side of the second, and the median over both pairs' windows cancels it to first order.
def compiled(run: dict | None) -> bool | None:
    """Whether the engine compiled the model at start (wrote into vLLM's compile cache); None if not recorded."""
    written = (run or {}).get("compile_cache_files_written")
    return None if written is None else written > 0


def tokens_per_s(windows: list[dict]) -> float:
    """A run's decode rate: all its windows' tokens over all their seconds."""
    return sum(w["tokens"] for w in windows) / sum(w["seconds"] for w in windows)


def window_ratios(legacy: dict, ext: dict) -> list[float]:
    """Extensible over legacy tokens/s, window by window (Note [Decode windows are paired]); ValueError naming
    what does not pair (different window counts, no windows, a window without time)."""
    lw, ew = legacy["throughput"]["windows"], ext["throughput"]["windows"]
    if len(lw) != len(ew) or not lw:
        raise ValueError(
            f"throughput pair: legacy timed {len(lw)} windows, extensible {len(ew)}; the windows are compared pairwise"
        )
    if any(w["seconds"] <= 0 or w["tokens"] <= 0 for w in lw + ew):
        raise ValueError(
            "throughput pair: a window with no tokens or no time: "
            f"legacy {[(w['tokens'], w['seconds']) for w in lw]}, "
            f"extensible {[(w['tokens'], w['seconds']) for w in ew]}"
        )
    return [(e["tokens"] / e["seconds"]) / (w["tokens"] / w["seconds"]) for w, e in zip(lw, ew)]


def throughput_benchmark(legacy_runs: Sequence[dict], ext_runs: Sequence[dict], machine: dict | None = None) -> dict:
    """pytest-benchmark-compatible JSON of ``--throughput`` runs, the i-th legacy run paired with the i-th
    extensible one: one benchmark per mode, each round a timed window, its time the
    seconds per generated token (``ops`` = tokens/s); ``extra_info`` carries tokens/s over all the mode's windows, the
    block count and the engine start seconds of its last run; the top-level ``ratio`` the extensible/legacy figures:
    decode as the median of the window-by-window ratios of every pair (target >= 0.99), engine start of the last runs
    with whether they are comparable (Notes [Decode windows are paired], [A start time needs the same compile cache],
    [Legacy, extensible, extensible, legacy])."""
    if not legacy_runs or len(legacy_runs) != len(ext_runs):
        raise ValueError(
            f"throughput pair: {len(legacy_runs)} legacy and {len(ext_runs)} extensible runs; the "
            "runs are compared in pairs"
        )
    ratios = [x for lr, er in zip(legacy_runs, ext_runs) for x in window_ratios(lr, er)]  # first: refuses bad pairs
    benches = []
    for mode, runs in (("legacy", legacy_runs), ("extensible", ext_runs)):
        windows = [w for r in runs for w in r["throughput"]["windows"]]
        last, case = runs[-1], runs[-1]["case"]
        benches.append(
            {
                "group": "serve/decode",
                "name": f"decode_throughput[{mode}]",
                "fullname": f"integration/run_case.py::decode_throughput[{case['model']}-{case['runner']}-{mode}]",
                "params": {"mode": mode},
                "param": mode,
                "options": {"timer": "time.perf_counter"},
                "stats": _stats([w["seconds"] / w["tokens"] for w in windows]),
                "extra_info": {
                    "key": f"serve/decode/{mode}",
                    "tokens_per_s": tokens_per_s(windows),
                    "runs": len(runs),
                    "num_seqs": last["throughput"]["num_seqs"],
                    "steps_per_window": last["throughput"]["steps_per_window"],
                    "num_gpu_blocks": last["memory"]["num_gpu_blocks"],
                    "engine_seconds": last["engine_seconds"],
                    "compiled": compiled(last),
                    "model": case["model"],
                    "runner": case["runner"],
                },
            }
        )
    blocks = {r["memory"]["num_gpu_blocks"] for r in legacy_runs + ext_runs}
    return {
        "machine_info": machine or {},
        "commit_info": {},
        "benchmarks": benches,
        "datetime": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "version": "5.2.3",
        "ratio": {
            "decode_tokens_per_s": statistics.median(ratios),
            "pairs": len(legacy_runs),
            "decode_window_ratios": ratios,
            "decode_range": [min(ratios), max(ratios)],
            "target_decode": 0.99,
            "engine_seconds": ext_runs[-1]["engine_seconds"] / legacy_runs[-1]["engine_seconds"],
            "engine_seconds_comparable": start_comparable(compiled(legacy_runs[-1]), compiled(ext_runs[-1])),
            "same_block_count": len(blocks) == 1,
        },
    }


@dataclass(frozen=True)
class Throughput:
    """Decode throughput of legacy and extensible at the same block count, one process each."""

    model: str
    runner: str
    num_gpu_blocks_override: int
    max_num_seqs: int = 256
    max_model_len: int = 8192
    capture_sizes: str = ""
    seconds: int = 90  # per run; on the H200 (8B shape): 81 s compiling, 66 s loading the compile cache
    timeout: int = 540
    group: str = "throughput"
    extra: tuple[str, ...] = field(default=())

    @property
    def id(self) -> str:
        return f"throughput-{self.model}-{self.runner}"

    def args(self, mode: str) -> list[str]:
        return [
            "--model",
            self.model,
            "--runner",
            self.runner,
            "--mode",
            mode,
            "--throughput",
            "--no-peak",
            "--no-sensitivity",
            "--num-gpu-blocks-override",
            str(self.num_gpu_blocks_override),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-model-len",
            str(self.max_model_len),
            "--capture-sizes",
            self.capture_sizes,
            *self.extra,
        ]

    def run_name(self, mode: str, repeat: int = 0) -> str:
        return f"{self.id}-{mode}" + (f"-r{repeat + 1}" if repeat else "")


def measured(run: dict | None) -> bool:
    """Whether a throughput run has its figures (not a failure, a refusal or a run not made)."""
    return bool(run) and "throughput" in run


# The order of a throughput case's runs: Note [Legacy, extensible, extensible, legacy].
THROUGHPUT_ORDER = (("legacy", 0), ("extensible", 0), ("extensible", 1), ("legacy", 1))


def throughput_pair(read: Callable[[str, int], dict | None]) -> dict:
    """A throughput case's runs, ``read(mode, repeat)`` called in ``THROUGHPUT_ORDER``: by mode, in pairing order
    (first, second)."""
    runs: dict = {"legacy": [None, None], "extensible": [None, None]}
    for mode, repeat in THROUGHPUT_ORDER:
        runs[mode][repeat] = read(mode, repeat)
    return runs


def measured_pairs(runs: dict) -> tuple[list[dict], list[dict]]:
    """The legacy and extensible runs of the pairs where both measured (first with first, second with second)."""
    both = [(lr, er) for lr, er in zip(runs["legacy"], runs["extensible"]) if measured(lr) and measured(er)]
    return [lr for lr, _ in both], [er for _, er in both]


def run_throughput(case: Throughput, runner: Runner, *, budget: Callable[[int], int | None] = lambda s: s) -> dict:
    """The runs in the order legacy, extensible, extensible, legacy (Note [Legacy, extensible, extensible, legacy]);
    by mode, in pairing order."""

    def run(mode: str, repeat: int) -> dict | None:
        timeout = budget(case.seconds)
        return (
            None
            if timeout is None
            else runner(
                case.run_name(mode, repeat), case.args(mode), min(timeout, case.timeout), timeout < case.timeout
            )
        )

    return throughput_pair(run)
