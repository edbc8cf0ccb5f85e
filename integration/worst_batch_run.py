"""The worst-batch matrix on a GPU: every case's engine, legacy and extensible, each in a fresh process, under the
adversarial load (``integration/load_generator.py``), with greedy parity, the KV blocks each path commits and the
blocks vLLM 0.34.0's margins would commit from the same measurements.

    python -m integration.worst_batch_run OUT [--only PATTERN ...] [--budget-seconds S] [--batches 200] [--list]
    python -m integration.worst_batch_run one --case NAME --mode legacy|extensible --out FILE [--batches N]

Resumable: a run whose JSON exists under ``OUT/worst-batch/`` is read, not rerun; ``--budget-seconds`` stops starting
runs that would not finish in time. Cases run most important first (the MLA shape under the issue's load, then the
Qwen3-0.6B shape). ``OUT/worst-batch-summary.json`` and ``OUT/worst-batch-table.md`` are rebuilt from every JSON
present at the end of every call.

Per run (``one``): the engine (``run_case``'s arguments, ``enable_sleep_mode`` for the sleep cases), its start
seconds, the figures after warmup (``run_case.memory_figures``), the extensible report (``measured.worst_batches``:
each worst batch's peak), the measured pass's greedy tokens (``run_case.measured_passes``), then the load generator's
bursts (seeded; a sleep/wake cycle every ``SLEEP_EVERY`` bursts in the sleep cases) read after every step against
the budget (Note [Over budget at the measured peak] in ``integration/parity.py``).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
GIB = 1 << 30
SLEEP_EVERY = 25  # bursts between sleep/wake cycles in the sleep cases
SEED = 41

# vLLM 0.34.0's constants (vllm/v1/worker/extensible_kv_cache.py), CUDA.
MARGIN_FLOOR_BYTES_034 = 1 << 30  # KV_CACHE_MARGIN_FLOOR_BYTES
MARGIN_FRACTION_034 = 0.75  # KV_CACHE_MARGIN_FRACTION
WARMUP_RESERVE_FRACTION_034 = 0.1  # KV_CACHE_WARMUP_RESERVE_FRACTION (bounds warmup's commits only)

# The load: max_model_len 512, 4096 batched tokens, 32 sequences, utilization 0.85.
MLA = dict(
    model="deepseek-v2-mla-shape",
    backend="FLASHMLA",
    max_model_len=512,
    max_num_batched_tokens=4096,
    max_num_seqs=32,
    util=0.85,
    prompt_len=400,
    capture_sizes="1,2,4,8,16,32",
)
QWEN = dict(model="qwen3-0.6b-shape", max_model_len=4096, max_num_seqs=8, util=0.85)
CASES: list[dict] = [
    dict(name="mla-v1", runner="v1", **MLA, seconds=100),
    dict(name="qwen3-v1", runner="v1", **QWEN, seconds=80),
    dict(name="mla-v2", runner="v2", **MLA, seconds=100),
    dict(name="mla-v1-sleep", runner="v1", **MLA, sleep=True, seconds=150),
    dict(name="qwen3-v2", runner="v2", **QWEN, seconds=120),
    dict(name="qwen3-v1-sleep", runner="v1", **QWEN, sleep=True, seconds=120),
    dict(
        name="llama8b-v1",
        runner="v1",
        model="llama-8b-shape",
        max_model_len=8192,
        max_num_seqs=256,
        util=0.85,
        capture_sizes="",
        seconds=200,
    ),
    dict(name="nemotron-h-v1", runner="v1", model="tiny-nemotron-h", max_model_len=2048, max_num_seqs=8, seconds=90),
    dict(name="swa-v1", runner="v1", model="tiny-llama-swa", max_model_len=2048, max_num_seqs=8, seconds=90),
    dict(name="mm-v1", runner="v1", model="tiny-mm", max_model_len=4096, max_num_seqs=8, seconds=120),
    dict(name="ngram-v1", runner="v1", **QWEN, speculative="ngram:4", seconds=120, key="ngram"),
    dict(name="llama8b-v2", runner="v2", model="llama-8b-shape", max_model_len=8192, max_num_seqs=256, util=0.85,
         capture_sizes="", seconds=200),
    dict(name="mla-v1-triton", runner="v1", **{**MLA, "backend": "TRITON_MLA"}, seconds=150),
]  # fmt: skip


def case_named(name: str) -> dict:
    for c in CASES:
        if c["name"] == name:
            return c
    raise SystemExit(f"no case {name!r}; cases: {', '.join(c['name'] for c in CASES)}")


def run_case_argv(case: dict, mode: str) -> list[str]:
    """``run_case``'s arguments for this case and mode (its parser builds the engine's)."""
    argv = ["--model", case["model"], "--runner", case["runner"], "--mode", mode, "--out", "unused"]
    argv += ["--backend", case.get("backend", "FLASH_ATTN")]
    argv += ["--max-model-len", str(case["max_model_len"]), "--max-num-seqs", str(case["max_num_seqs"])]
    argv += ["--gpu-memory-utilization", str(case.get("util", 0.9))]
    if case.get("max_num_batched_tokens"):
        argv += ["--max-num-batched-tokens", str(case["max_num_batched_tokens"])]
    if "capture_sizes" in case:
        argv += ["--capture-sizes", case["capture_sizes"]]
    if case.get("speculative"):
        argv += ["--speculative", case["speculative"]]
    if case.get("prompt_len"):
        argv += ["--prompt-len", str(case["prompt_len"])]
    return argv


# -- vLLM 0.34.0's margins, applied to the same measurements -------------------------------------------------------
def margins_034_bytes(
    init_free: int, free_memory: int, committed_bytes: int, requested: int, transient_peak: int, reserve_growth: int
) -> int:
    """``measure_kv_cache_bytes`` of vLLM 0.34.0: the KV bytes its margins leave. ``free_memory`` is read with torch's
    cache emptied; ``transient_peak`` is the largest allocated transient it knows (``reserved_headroom_bytes``),
    ``reserve_growth`` torch's reservation growth. (Its 10% warmup reserve bounds only what warmup may commit.)"""
    non_kv_used = init_free - free_memory - committed_bytes
    headroom = free_memory + committed_bytes
    margin = max(MARGIN_FLOOR_BYTES_034, int(transient_peak * MARGIN_FRACTION_034))
    available = min(requested - non_kv_used, headroom - margin)
    available -= max(transient_peak, reserve_growth)
    return max(available, 0)


def margins_034_blocks(measured: dict, profiled_peak: int) -> int | None:
    """Blocks vLLM 0.34.0's margins would commit from the extensible run's measurements (``measured``: the worker's
    ``MemoryState.to_dict()``): the same free memory after warmup (torch's retained cache counted free, as 0.34
    empties it first), the largest allocated transient seen (vLLM's profile or a worst batch)."""
    if not measured:
        return None
    worst_alloc = max((b.get("peak_allocated", 0) for b in measured.get("worst_batches") or ()), default=0)
    transient = max(profiled_peak, worst_alloc)
    retained = measured.get("served_retained", 0)
    available = margins_034_bytes(
        init_free=measured["init_free"],
        free_memory=measured["free_now"] + retained,
        committed_bytes=measured["kv_backed"],
        requested=measured["requested"],
        transient_peak=transient,
        reserve_growth=measured.get("torch_growth", 0),
    )
    fit = max(0, available - measured["rounding_bound"]) // measured["bytes_per_block"]
    return int(min(measured["capacity_blocks"], fit))


# -- one engine (in its own process) -------------------------------------------------------------------------------
def _prompt_of(config: dict, image_tokens: int, max_model_len: int):
    """A multimodal case's prompts: an image where the request still fits max_model_len with it."""
    from integration.run_case import IMAGE_TEXT_BEFORE, vllm_prompts

    marker = [config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]]

    def prompt_of(request, name):
        if len(request.prompt) + image_tokens + 2 + request.max_tokens > max_model_len:
            return {"prompt_token_ids": request.prompt}
        seed = 50_000 + int(re.sub(r"\D", "", re.sub(r"p\d+", "", name)) or 0)  # both passes: the same image
        ids = request.prompt[:IMAGE_TEXT_BEFORE] + marker + request.prompt[IMAGE_TEXT_BEFORE:]
        return vllm_prompts([{"prompt_token_ids": ids, "image_seed": seed}])[0]

    return prompt_of


def one(case: dict, mode: str, out: Path, batches: int, seconds: float, trace: bool = False) -> dict:
    """One engine of ``case`` in ``mode`` under the load. ``trace``: what was live at the peaks and where it was
    allocated (``memory_trace``), for each worst batch and profile run at start and the served step that allocated
    the most (``memory_trace`` in the result, ``load.highest_allocated.trace``)."""
    from integration import load_generator as lg
    from integration import memory_trace
    from integration import run_case as rc

    args = rc.parser().parse_args(run_case_argv(case, mode))
    rc._env(args)
    config = rc.model_config(args.model)
    if (missing := rc.refused_import(config, args.model)) is not None:
        return {"case": case, "mode": mode, "refused": missing}
    kwargs = rc.engine_kwargs(args)
    if case.get("sleep"):
        kwargs["enable_sleep_mode"] = True
    record = rc.RunnerRecord()
    rc.record_runner_memory(record)
    from vllm import LLM

    from extensible_kv.vllm import extensible_kv_cache

    start = time.perf_counter()
    traced: dict = {}
    try:
        with (
            extensible_kv_cache() if mode == "extensible" else _nothing(),
            memory_trace.engine_start(traced) if trace else _nothing(),
        ):
            llm = LLM(**kwargs)
    except rc._refusal_types() as exc:
        return {"case": case, "mode": mode, "refused": f"{type(exc).__name__}: {exc}"}
    engine_seconds = time.perf_counter() - start
    deadline = time.monotonic() + seconds
    warmup = rc.warmup_figures(llm, mode, record)
    llm.apply_model(rc.reinit_weights)
    batch = rc.measured_batch(args, config)
    passes = rc.measured_passes(llm, batch, args.max_tokens, False, rc.is_multimodal(config))
    shape = load_shape(llm, config)
    bursts = lg.plan(shape, SEED, batches, SLEEP_EVERY if case.get("sleep") else None)
    prompt_of = None
    if rc.is_multimodal(config):
        budget = llm.collective_rpc(rc.encoder_budget)[0]
        prompt_of = _prompt_of(config, budget["tokens_per_item"], shape.max_model_len) if budget else None
    load = lg.drive(llm, bursts, SEED, deadline=deadline, prompt_of=prompt_of, trace=trace)
    # Note [Torch's cache, held to the budget] in sizing: the soft cap's trims happen under the load, so read after it
    cap_after = llm.collective_rpc("extensible_kv_report")[0].get("torch_cap") if mode == "extensible" else None
    memory = rc.as_written(warmup.memory[0])
    extensible = rc.as_written(warmup.extensible[0]) if warmup.extensible else None
    measured = (extensible or {}).get("measured")
    return {
        "case": case,
        "mode": mode,
        "engine_seconds": round(engine_seconds, 2),
        "compiled": record.graph_memory != [],
        "num_gpu_blocks": memory["num_gpu_blocks"],
        "memory": memory,
        "extensible": extensible,
        "margins_034_blocks": margins_034_blocks(measured, memory.get("profiled_peak_activation") or 0),
        "token_ids": passes["token_ids"],
        "load": lg.report_dict(load),
        "torch_cap_after_load": cap_after,
        **({"memory_trace": traced} if trace else {}),
    }


def load_shape(llm, config: dict):
    """The load generator's view of an engine: its scheduler's limits and the text token ids its model takes."""
    from integration import load_generator as lg
    from integration import run_case as rc

    vllm_config = llm.llm_engine.vllm_config
    return lg.Shape(
        max_model_len=vllm_config.model_config.max_model_len,
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        vocab=rc.text_token_limit(config),
    )


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- the matrix ----------------------------------------------------------------------------------------------------
def _mib(v) -> str:
    return "-" if v is None else f"{v / MIB:+.1f}"


def component_rows(path: Path) -> list[dict]:
    """Per component of one extensible run: the worst batch that brought its peak back (the most allocated among
    the batches that target it, since the batch began) beside vLLM's profiled peak and the most the generator's
    load allocated in one step (whole steps: a step holds every component at once), as the batches count it: its
    allocated peak less torch's allocated bytes at rest (read after the burst that came closest to the budget);
    and whether the case fits; [] without the run."""
    if not path.exists():
        return []
    run = json.loads(path.read_text())
    measured = (run.get("extensible") or {}).get("measured") or {}
    load = run.get("load") or {}
    top = load.get("highest_allocated") or {}
    burst = top.get("burst") or {}
    rest = ((load.get("highest") or {}).get("reading") or {}).get("torch_allocated")
    step = top["peak_allocated"] - rest if top.get("peak_allocated") is not None and rest is not None else None
    over = load.get("highest_over_budget")
    fits = not (load.get("errors") or run.get("error")) and over is not None and over <= 0
    best: dict[str, dict] = {}
    for b in measured.get("worst_batches") or ():
        for component in b.get("targets") or ():
            if component not in best or b.get("peak_allocated", 0) > best[component].get("peak_allocated", 0):
                best[component] = b
    return [
        {
            "case": path.stem.removesuffix("-extensible"),
            "component": component,
            "batch": b.get("name"),
            "batch_allocated_mib": _in_mib(b.get("peak_allocated")),
            "batch_reserved_mib": _in_mib(b.get("peak_reserved")),
            "profiled_mib": _in_mib(measured.get("profiled_peak")),
            "generator_step_mib": _in_mib(step),
            "generator_burst": f"{burst.get('kind')} #{burst.get('index')}" if burst else None,
            "case_fits": fits,
        }
        for component, b in sorted(best.items())
    ]


def _in_mib(value) -> float | None:
    return None if value is None else round(value / MIB, 1)


def summarize(folder: Path) -> dict:
    rows = []
    for case in CASES:
        runs = {}
        for mode in ("legacy", "extensible"):
            path = folder / f"{case['name']}-{mode}.json"
            if path.exists():
                runs[mode] = json.loads(path.read_text())
        if not runs:
            continue
        leg, ext = runs.get("legacy", {}), runs.get("extensible", {})
        row = {"case": case["name"]}
        for mode, r in (("legacy", leg), ("extensible", ext)):
            load = r.get("load") or {}
            row[f"{mode}_over_budget"] = load.get("highest_over_budget")
            row[f"{mode}_closest"] = load.get("highest")
            row[f"{mode}_blocks"] = r.get("num_gpu_blocks")
            row[f"{mode}_seconds"] = r.get("engine_seconds")
            row[f"{mode}_refused"] = r.get("refused")
            row[f"{mode}_bursts"] = load.get("bursts")
            row[f"{mode}_errors"] = (load.get("errors") or []) + ([r["error"]] if r.get("error") else [])
        row["margins_034_blocks"] = ext.get("margins_034_blocks")
        # Note [Torch's cache, held to the budget] in sizing: the cap the worker set, and torch's reserve at the
        # reading that came closest to the budget.
        row["torch_cap"] = ((ext.get("extensible") or {}).get("torch_cap") or {}).get("cap")
        row["torch_cap_trims"] = (ext.get("torch_cap_after_load") or {}).get("trims")
        row["torch_reserved_closest"] = (((ext.get("load") or {}).get("highest") or {}).get("reading") or {}).get(
            "torch_reserved"
        )
        if leg.get("token_ids") is not None and ext.get("token_ids") is not None:
            row["tokens_identical"] = leg["token_ids"] == ext["token_ids"]
        if leg.get("engine_seconds") and ext.get("engine_seconds"):
            row["start_ratio"] = round(ext["engine_seconds"] / leg["engine_seconds"], 3)
        measured = ((ext.get("extensible") or {}).get("measured")) or {}
        row["worst_batches"] = [
            {k: b.get(k) for k in ("name", "peak_reserved", "peak_allocated", "seconds")}
            for b in measured.get("worst_batches") or ()
        ]
        # A case fits where its extensible engine ran the whole load without an error and stayed within the budget;
        # one whose engine failed (an error, a crash) does not, whatever the readings before it said.
        row["fits"] = (
            not row["extensible_errors"]
            and row.get("extensible_over_budget") is not None
            and row["extensible_over_budget"] <= 0
        )
        rows.append(row)
    lines = [
        "| case | ext over budget MiB | legacy MiB | blocks ext / legacy / 0.34 | start ext/legacy | tokens | bursts "
        "| ext errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {_mib(r.get('extensible_over_budget'))} | {_mib(r.get('legacy_over_budget'))} | "
            f"{r.get('extensible_blocks')} / {r.get('legacy_blocks')} / {r.get('margins_034_blocks')} | "
            f"{r.get('start_ratio', '-')} | {r.get('tokens_identical', '-')} | "
            f"{r.get('extensible_bursts')}/{r.get('legacy_bursts')} | {len(r['extensible_errors'])} |"
        )
    ran = [r for r in rows if r.get("extensible_over_budget") is not None or r["extensible_errors"]]
    verdict = bool(ran) and all(r["fits"] for r in ran)
    components = [c for case in CASES for c in component_rows(folder / f"{case['name']}-extensible.json")]
    summary = {"rows": rows, "components": components, "all_within_budget": verdict, "table": "\n".join(lines)}
    (folder.parent / "worst-batch-summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (folder.parent / "worst-batch-table.md").write_text(summary["table"] + "\n")
    return summary


def matrix(args: argparse.Namespace) -> int:
    out = Path(args.out)
    folder = out / "worst-batch"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # in the order of the --only patterns (the most wanted first, where the time box may stop the rest)
    picked = [c for p in args.only for c in CASES if fnmatch.fnmatch(c["name"], p)] if args.only else CASES
    cases = [c for i, c in enumerate(picked) if c not in picked[:i]]
    if args.list:
        for c in cases:
            print(c["name"], c["seconds"])
        return 0
    for case in cases:
        for mode in ("legacy", "extensible"):
            path = folder / f"{case['name']}-{mode}.json"
            if path.exists():
                continue
            left = args.budget_seconds - (time.monotonic() - started)
            need = case["seconds"] + 60  # the engine's start, then the load's time box
            if left < need:
                print(f"stopping: {left:.0f} s left, {case['name']} {mode} needs {need}", flush=True)
                summarize(folder)
                return 0
            cmd = [sys.executable, "-m", "integration.worst_batch_run", "one", "--case", case["name"]]
            cmd += ["--mode", mode, "--out", str(path), "--batches", str(args.batches)]
            cmd += ["--trace-memory"] if args.trace_memory else []
            log = folder / f"{case['name']}-{mode}.log"
            t0 = time.monotonic()
            with log.open("w") as f:
                try:
                    done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=need + 120)
                    rc = done.returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            if not path.exists():
                tail = log.read_text()[-3000:]
                path.write_text(json.dumps({"case": case, "mode": mode, "error": f"exit {rc}", "log_tail": tail}))
            print(f"{case['name']} {mode}: exit {rc} in {time.monotonic() - t0:.0f} s", flush=True)
    summary = summarize(folder)
    print(summary["table"])
    print(
        "verdict:",
        "every case run within budget" if summary["all_within_budget"] else "OVER BUDGET or FAILED somewhere",
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "one":
        p = argparse.ArgumentParser(prog="python -m integration.worst_batch_run one")
        p.add_argument("--case", required=True)
        p.add_argument("--mode", choices=["legacy", "extensible"], required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--batches", type=int, default=200)
        p.add_argument("--trace-memory", action="store_true", help="replay torch's allocations at the peaks")
        a = p.parse_args(argv[1:])
        case = case_named(a.case)
        result = one(case, a.mode, Path(a.out), a.batches, case["seconds"], a.trace_memory)
        Path(a.out).write_text(json.dumps(result, default=str))
        load = result.get("load") or {}
        print(json.dumps({k: result.get(k) for k in ("mode", "engine_seconds", "num_gpu_blocks", "refused")}))
        print("highest over budget MiB:", _mib(load.get("highest_over_budget")))
        return 0
    p = argparse.ArgumentParser(prog="python -m integration.worst_batch_run")
    p.add_argument("out")
    p.add_argument("--only", action="append", default=[])
    p.add_argument("--budget-seconds", type=float, default=540)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--list", action="store_true")
    p.add_argument("--trace-memory", action="store_true", help="every run replays torch's allocations at its peaks")
    return matrix(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
