"""vLLM's own extensible KV cache (0.34 and later: ``enable_extensible_kv_cache``) on the GPU against the same engine
with it off: greedy tokens, the KV blocks each commits, and the adversarial load's highest memory over the budget.

    python -m integration.native_run OUT [--only PATTERN ...] [--budget-seconds S] [--batches N] [--seconds S]
    python -m integration.native_run one --case NAME --mode off|native --out FILE [--batches N]

The cases are ``worst_batch_run``'s V2 cases (vLLM 0.34 has no V1 runner), built by ``run_case``'s engine arguments
with ``enable_extensible_kv_cache`` set: ``off`` is vLLM's preallocated KV cache, ``native`` its extensible one.
Each engine runs in a fresh process (``one``): its start seconds, what the worker reads after warmup (requested
memory, free memory, blocks, whether the extensible cache is on), the measured pass's greedy tokens over seeded
weights (``run_case.measured_passes``), then the load generator's bursts (``integration/load_generator.py``, the
seed ``worst_batch_run`` uses) read after every step against the budget. The load generator and this file never
import the package's sizing: they measure vLLM's. Resumable: a run whose JSON exists under ``OUT`` is read, not
rerun; ``--budget-seconds`` stops starting runs that would not finish in time. ``OUT/native-summary.json`` and
``OUT/native-table.md`` are rebuilt at the end of every call.

Note [vLLM's native path on a torch it does not pin]
    Rule: nothing of this harness depends on the installed vLLM's version beyond ``LLM``'s public arguments, the
    worker's ``init_snapshot`` and ``requested_memory`` and ``collective_rpc`` of a function; the engine is
    told its utilization (0.34 raises the default to 1.0 when its extensible cache is on), so both modes promise
    the same budget.
    Why: the comparison is of one vLLM with its feature on and off; a harness that patched vLLM would measure
    itself. Figure: the harness's own cost is one RPC per engine step (``load_generator._reading``).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from integration.worst_batch_run import CASES, SEED, case_named, load_shape, run_case_argv

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
MODES = ("off", "native")
NATIVE_CASES = [c for c in CASES if c["runner"] == "v2"]


def worker_figures(worker) -> dict:
    """In the worker after warmup: the budget's terms and the cache vLLM committed."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    cache = worker.cache_config
    return {
        "total": int(total),
        "init_free": int(worker.init_snapshot.free_memory),
        "requested": int(worker.requested_memory),
        "free_after_warmup": int(free),
        "used_after_warmup": int(worker.init_snapshot.free_memory) - int(free),
        "num_gpu_blocks": int(cache.num_gpu_blocks),
        "extensible": bool(getattr(cache, "enable_extensible_kv_cache", False)),
        "torch_reserved": int(torch.cuda.memory_reserved()),
        "torch_allocated": int(torch.cuda.memory_allocated()),
    }


def one(case: dict, mode: str, batches: int, seconds: float) -> dict:
    """One engine of ``case`` with vLLM's extensible KV cache ``mode``, under the load."""
    from integration import load_generator as lg
    from integration import run_case as rc

    args = rc.parser().parse_args(run_case_argv(case, "legacy"))
    rc._env(args)
    os.environ.setdefault("PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK", "1")
    config = rc.model_config(args.model)
    kwargs = rc.engine_kwargs(args)
    kwargs["enable_extensible_kv_cache"] = mode == "native"
    import vllm
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(**kwargs)
    engine_seconds = time.perf_counter() - start
    deadline = time.monotonic() + seconds
    figures = llm.collective_rpc(worker_figures)[0]
    llm.apply_model(rc.reinit_weights)
    passes = rc.measured_passes(llm, rc.measured_batch(args, config), args.max_tokens, False, False)
    load = lg.drive(llm, lg.plan(load_shape(llm, config), SEED, batches), SEED, deadline=deadline)
    return {
        "case": case,
        "mode": mode,
        "vllm": vllm.__version__,
        "engine_seconds": round(engine_seconds, 2),
        "figures": figures,
        "num_gpu_blocks": figures["num_gpu_blocks"],
        "token_ids": passes["token_ids"],
        "load": lg.report_dict(load),
    }


# -- the matrix --------------------------------------------------------------------------------------------------------
def selected(patterns: list[str]) -> list[dict]:
    if not patterns:
        return NATIVE_CASES
    return [c for c in NATIVE_CASES if any(fnmatch.fnmatch(c["name"], p) for p in patterns)]


def finished(path: Path) -> dict | None:
    """The run a JSON file holds, if it ran to its end (no ``error``); ``None`` for a missing, unreadable or failed
    one, which the matrix runs again."""
    run = _read(path)
    return run if run is not None and "error" not in run else None


def _read(path: Path) -> dict | None:
    """The run a JSON file holds; ``None`` where there is no file, an ``error`` naming why where it cannot be read."""
    try:
        run = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"error": f"unreadable {path.name}: {type(exc).__name__}"} if path.exists() else None
    return run if isinstance(run, dict) else {"error": f"{path.name} holds no object"}


def summarize(folder: Path) -> dict:
    """One row per case from the JSON files present: blocks, start seconds and the highest over budget of each
    mode, whether the tokens match, and any error."""
    rows = []
    for case in NATIVE_CASES:
        runs = {m: r for m in MODES if (r := _read(folder / f"{case['name']}-{m}.json")) is not None}
        if not runs:
            continue
        row: dict = {"case": case["name"]}
        for mode, run in runs.items():
            load = run.get("load") or {}
            row[f"{mode}_blocks"] = run.get("num_gpu_blocks")
            row[f"{mode}_seconds"] = run.get("engine_seconds")
            row[f"{mode}_over_budget"] = load.get("highest_over_budget")
            row[f"{mode}_bursts"] = load.get("bursts")
            row[f"{mode}_extensible"] = (run.get("figures") or {}).get("extensible")
            errors = [e for e in load.get("errors") or [] if "time box" not in str(e)]  # a time box is no error
            row[f"{mode}_errors"] = errors + ([run["error"]] if run.get("error") else [])
            row["vllm"] = run.get("vllm") or row.get("vllm")
        if all(runs.get(m, {}).get("token_ids") is not None for m in MODES):
            row["tokens_identical"] = runs["off"]["token_ids"] == runs["native"]["token_ids"]
        rows.append(row)
    summary = {"rows": rows}
    (folder / "native-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (folder / "native-table.md").write_text(render(rows))
    return summary


def _mib(v) -> str:
    return "-" if v is None else f"{v / MIB:+.1f}"


def _cell(v) -> str:
    return "-" if v is None else str(v)


def render(rows: list[dict]) -> str:
    lines = [
        "| case | vLLM | blocks off / native | over budget MiB off / native | start s off / native | tokens identical "
        "| extensible on (off / native) | errors |",
        "|" + " --- |" * 8,
    ]
    for r in rows:
        errors = "; ".join(str(e)[:120] for m in MODES for e in r.get(f"{m}_errors") or []) or "-"
        lines.append(
            f"| {r['case']} | {_cell(r.get('vllm'))} | {_cell(r.get('off_blocks'))} / "
            f"{_cell(r.get('native_blocks'))} | {_mib(r.get('off_over_budget'))} / {_mib(r.get('native_over_budget'))} "
            f"| {_cell(r.get('off_seconds'))} / {_cell(r.get('native_seconds'))} | {_cell(r.get('tokens_identical'))} "
            f"| {_cell(r.get('off_extensible'))} / {_cell(r.get('native_extensible'))} | {errors} |"
        )
    return "\n".join(lines) + "\n"


def matrix(
    out: Path,
    patterns: list[str],
    budget_s: float,
    batches: int,
    seconds: float | None = None,
    modes: tuple[str, ...] = MODES,
) -> int:
    """Every selected case in ``modes`` (in that order), each engine in its own process, within ``budget_s``;
    ``seconds``: the load's time box per engine (default: the case's own)."""
    cases = selected(patterns)
    if not cases:
        names = ", ".join(c["name"] for c in NATIVE_CASES)
        print(f"no case matches {' '.join(patterns)}; cases: {names}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    status = 0
    for case in cases:
        for mode in modes:
            path = out / f"{case['name']}-{mode}.json"
            if finished(path) is not None:
                continue
            box = case["seconds"] if seconds is None else seconds
            need = box + 90  # the engine's start and the passes, beside the load's time box
            left = deadline - time.monotonic()
            if left < need:
                print(f"{case['name']} {mode}: {left:.0f} s left, needs {need} s: not started", flush=True)
                status = 1
                continue
            cmd = [sys.executable, "-m", "integration.native_run", "one", "--case", case["name"], "--mode", mode]
            cmd += ["--out", str(path), "--batches", str(batches), "--seconds", str(box)]
            log = out / f"{case['name']}-{mode}.txt"
            t0 = time.monotonic()
            with open(log, "w") as f:
                try:
                    rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=left).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            print(f"{case['name']} {mode}: exit {rc} in {time.monotonic() - t0:.0f} s", flush=True)
            run = _read(path)
            if run is None or "error" in run:
                status = 1
                if (run or {}).get("traceback") is None:  # no word from the engine's own process: its log's tail
                    tail = log.read_text(errors="replace").splitlines()[-15:]
                    path.write_text(json.dumps({"case": case, "mode": mode, "error": f"exit {rc}", "log_tail": tail}))
    print(render(summarize(out)["rows"]), flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["one"]:
        p = argparse.ArgumentParser(prog="python -m integration.native_run one")
        p.add_argument("--case", required=True)
        p.add_argument("--mode", choices=MODES, required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--batches", type=int, default=200)
        p.add_argument("--seconds", type=float, default=None, help="the load's time box (default: the case's)")
        args = p.parse_args(argv[1:])
        case = case_named(args.case)
        try:
            result = one(case, args.mode, args.batches, case["seconds"] if args.seconds is None else args.seconds)
        except Exception as exc:  # recorded: the matrix goes on with the next engine
            import traceback

            result = {"case": case, "mode": args.mode, "error": f"{type(exc).__name__}: {exc}"}
            result["traceback"] = traceback.format_exc()[-4000:]
        Path(args.out).write_text(json.dumps(result, default=str) + "\n")
        return 0 if "error" not in result else 1
    p = argparse.ArgumentParser(prog="python -m integration.native_run")
    p.add_argument("out")
    p.add_argument("--only", action="append", default=[])
    p.add_argument("--budget-seconds", type=float, default=540)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--seconds", type=float, default=None, help="each engine's load time box (default: the case's)")
    p.add_argument("--mode", action="append", choices=MODES, help="these modes, in this order (default: off, native)")
    args = p.parse_args(argv)
    modes = tuple(dict.fromkeys(args.mode)) if args.mode else MODES
    return matrix(Path(args.out), args.only, args.budget_seconds, args.batches, args.seconds, modes)


if __name__ == "__main__":
    sys.exit(main())
