"""vLLM 0.26.0's sleep mode on a GPU, legacy and extensible KV cache, V1 and V2 runners: device memory awake, asleep
and after wake, sleep and wake times, greedy tokens before sleep and after every wake, a weights-only wake, ten
sleep/wake cycles and a level-2 sleep. Every case runs in its own process.

    PYTHONPATH=/tmp/site:$PWD/reference:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python3 integration/sleep_mode.py OUT [--only PATTERN ...] [--budget-seconds 390] [--list]

Writes ``OUT/<case>.json`` and ``OUT/<case>.log`` per case, then ``OUT/summary.json`` and ``OUT/table.md``, and
prints the table last. Resumable: a case whose JSON says ``complete`` is read, not run again. ``--budget-seconds``
stops starting cases whose estimate no longer fits (they are listed as skipped).

The cases: the Qwen3-0.6B shape of the matrix (``integration/models/qwen3-0.6b-shape``, ``max_model_len`` 4096, 8
sequences) on V1 and V2, and the hybrid attention + Mamba model ``tiny-jamba`` on V1 (3 cycles), each legacy and
extensible, all at ``gpu_memory_utilization`` 0.85 with ``enable_sleep_mode=True``. The engine is built as
``integration/run_case`` builds it (dummy weights re-initialised from a seeded normal, token-id prompts, no network,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, CUDA graphs captured).

A case, in order, with a reading (``reading``: ``torch.cuda.mem_get_info`` used bytes, nvidia-smi's used bytes, the
KV tensors' addresses and, extensible, the driver's mappings and reservations) after each step:

1. ``before``: tokens: a one-token pass that fills the prefix cache, then the measured greedy pass (24 tokens over
   4 prompts of 40 tokens) that reads it. Every phase ends with tokens the same way.
2. ``sleep_wake``: ``sleep(level=1)``, ``wake_up()``, tokens (the prefix cache was reset on sleep: the one-token
   pass must find nothing in it, ``cached after wake``).
3. ``weights_then_kv``: ``sleep(level=1)``, ``wake_up(tags=["weights"])`` (the KV cache must stay released: the
   memory ``wake_up(tags=["kv_cache"])`` brings back is the KV cache's size), ``wake_up(tags=["kv_cache"])``, tokens.
4. ``cycles``: ``sleep(level=1)`` / ``wake_up()`` ten times, a reading after each wake; tokens after the last.
5. ``level2``: ``sleep(level=2)``, ``wake_up()``, the weights re-initialised again (level 2 drops them), tokens.

``summarize`` turns the case files into one row per case and one comparison per (model, runner) pair.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # python integration/sleep_mode.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
MIB, GIB = 1 << 20, 1 << 30
UTILIZATION = 0.85
TOLERANCE = 64 * MIB  # the issue's tolerance for memory comparisons
MAX_TOKENS = 24
PHASES = ("before", "sleep_wake", "weights_then_kv", "cycles", "level2")
MODES = ("legacy", "extensible")


@dataclass(frozen=True)
class Case:
    model: str
    runner: str
    mode: str
    max_model_len: int
    cycles: int
    seconds: int  # expected wall time, engine start included
    timeout: int = 300

    @property
    def id(self) -> str:
        return f"{self.model}-{self.runner}-{self.mode}"


def _cases() -> tuple[Case, ...]:
    qwen = [Case("qwen3-0.6b-shape", runner, mode, 4096, 10, 75) for runner in ("v1", "v2") for mode in MODES]
    hybrid = [Case("tiny-jamba", "v1", mode, 256, 3, 45) for mode in MODES]
    return tuple(qwen + hybrid)


CASES = _cases()


def select(cases: Sequence[Case], only: Sequence[str] | None) -> list[Case]:
    """Cases whose id matches any ``only`` pattern (fnmatch, or a substring); all of them without ``only``."""
    if not only:
        return list(cases)
    return [c for c in cases if any(fnmatch.fnmatch(c.id, p) or p in c.id for p in only)]


# -- one case, on the GPU ------------------------------------------------------------------------------------------
def nvidia_smi_used() -> int | None:
    """Bytes nvidia-smi reports in use on this process's first visible GPU; ``None`` where nvidia-smi cannot say."""
    index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0] or "0"
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", index],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines or not lines[0].strip().isdigit():
        return None
    return int(lines[0].strip()) * MIB


def reading(worker) -> dict:
    """Runs on the worker (``collective_rpc``): device memory in use, the KV tensors' addresses, the KV bytes, and for
    the extensible path whether the pages are released and what the driver holds (mappings, reservations, handles
    a failed release left behind)."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    runner = worker.model_runner
    ptrs: set[int] = set()
    for value in getattr(runner, "kv_caches", None) or ():
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                ptrs.add(int(t.data_ptr()))
    out = {
        "used": int(total - free),
        "total": int(total),
        "torch_reserved": int(torch.cuda.memory_reserved()),
        "kv_ptrs": sorted(ptrs),
        "kv": None,
    }
    state = getattr(worker, "_extensible_kv_state", None)
    if state is None or state.buffers is None:
        out["kv_bytes"] = int(sum(t.size for t in runner.kv_cache_config.kv_cache_tensors))
        return out
    buffers, driver = state.buffers, state.driver
    tensors = [buffers.tensor(b.name) for b in buffers.buffers]
    out["kv_bytes"] = int(buffers.num_blocks * sum(b.page_size_bytes for b in buffers.buffers))
    kv = {
        "released": bool(getattr(buffers, "released", False)),
        "num_blocks": int(buffers.num_blocks),
        "bases": [int(t.base_address) for t in tensors],
        "driver_mappings": len(getattr(driver, "_mappings", {})),
        "driver_reservations": len(getattr(driver, "_reservations", {})),
        "unreleased_handles": sum(len(getattr(getattr(t, "_memory", None), "unreleased", ())) for t in tensors),
    }
    try:
        stats = buffers.stats()
        kv.update(backed_bytes=int(stats.backed_bytes), committed_bytes=int(stats.committed_bytes))
    except Exception as exc:  # recorded, not fatal: the reading is still useful
        kv["stats_error"] = f"{type(exc).__name__}: {exc}"
    out["kv"] = kv
    return out


def write_json(path: Path, data: dict) -> None:
    """Whole or not at all: a case killed mid-write leaves the previous file."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _engine(case: Case, path: Path):
    """The run_case arguments and environment of this case; returns (LLM kwargs, run_case module)."""
    from integration import run_case

    args = run_case.parser().parse_args(
        [
            "--model",
            case.model,
            "--runner",
            case.runner,
            "--mode",
            case.mode,
            "--max-model-len",
            str(case.max_model_len),
            "--gpu-memory-utilization",
            str(UTILIZATION),
            "--out",
            str(path),
        ]
    )
    run_case._env(args)  # before vLLM is imported: in-process engine, runner, no network
    sys.path.insert(0, str(ROOT / "reference"))
    return dict(run_case.engine_kwargs(args), enable_sleep_mode=True), run_case


def run_one(case: Case, path: Path) -> dict:
    """Run one case in this process, writing ``path`` after every phase."""
    kwargs, run_case = _engine(case, path)
    result: dict = {
        "case": asdict(case) | {"id": case.id},
        "engine": {k: str(v) for k, v in kwargs.items()},
        "phases": {},
        "complete": False,
    }
    from vllm import LLM, SamplingParams

    from extensible_kv.vllm import ExtensibleKVUnsupported, extensible_kv_cache

    start = time.perf_counter()
    try:
        with extensible_kv_cache() if case.mode == "extensible" else nullcontext():
            llm = LLM(**kwargs)
    except (ValueError, NotImplementedError, ExtensibleKVUnsupported) as exc:
        result["refused"] = f"{type(exc).__name__}: {exc}"
        write_json(path, result)
        return result
    result["engine_seconds"] = round(time.perf_counter() - start, 2)
    ext = case.mode == "extensible"
    result["extensible"] = llm.collective_rpc("extensible_kv_report")[0] if ext else None
    llm.apply_model(run_case.reinit_weights)
    vocab = run_case.text_token_limit(run_case.model_config(case.model))
    batch = [{"prompt_token_ids": p} for p in run_case.prompts(vocab)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)

    def tokens() -> dict:
        """A one-token pass (what it found in the prefix cache: nothing right after a wake), then the measured pass,
        which reads the blocks the first one cached: every phase's tokens come the same way."""
        first = llm.generate(batch, warm, use_tqdm=False)
        outs = llm.generate(batch, params, use_tqdm=False)
        return {
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [getattr(o, "num_cached_tokens", None) for o in outs],
            "warm_cached_tokens": [getattr(o, "num_cached_tokens", None) for o in first],
        }

    def read() -> dict:
        r = llm.collective_rpc(reading)[0]
        r["nvidia_smi_used"] = nvidia_smi_used()
        return r

    def timed(fn: Callable[[], object]) -> float:
        t = time.perf_counter()
        fn()
        return round(time.perf_counter() - t, 4)

    def before() -> dict:
        return {"tokens": tokens(), "memory": read()}

    def sleep_wake() -> dict:
        out = {"sleep_s": timed(lambda: llm.sleep(level=1)), "asleep": read()}
        out.update(wake_s=timed(llm.wake_up), woken=read())
        out["tokens"] = tokens()
        return out

    def weights_then_kv() -> dict:
        out = {"sleep_s": timed(lambda: llm.sleep(level=1)), "asleep": read()}
        out.update(weights_wake_s=timed(lambda: llm.wake_up(tags=["weights"])), weights_woken=read())
        out.update(kv_wake_s=timed(lambda: llm.wake_up(tags=["kv_cache"])), kv_woken=read())
        out["tokens"] = tokens()
        return out

    def cycles() -> dict:
        rows = []
        for _ in range(case.cycles):
            row = {"sleep_s": timed(lambda: llm.sleep(level=1))}
            row.update(wake_s=timed(llm.wake_up), after_wake=read())
            rows.append(row)
        return {"cycles": rows, "tokens": tokens()}

    def level2() -> dict:
        out = {"sleep_s": timed(lambda: llm.sleep(level=2)), "asleep": read()}
        out.update(wake_s=timed(llm.wake_up), woken=read())
        llm.apply_model(run_case.reinit_weights)  # level 2 dropped the weights; the same seed makes them again
        out["tokens"] = tokens()
        return out

    for name, phase in zip(PHASES, (before, sleep_wake, weights_then_kv, cycles, level2), strict=True):
        try:
            result["phases"][name] = phase()
        except Exception as exc:  # the case file says which phase failed; later phases are skipped
            result["error"] = {
                "phase": name,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:],
            }
            write_json(path, result)
            return result
        write_json(path, result)
    if ext:
        result["extensible_after"] = llm.collective_rpc("extensible_kv_report")[0]
    result["complete"] = True
    write_json(path, result)
    return result


# -- the summary (pure) --------------------------------------------------------------------------------------------
def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _same(*token_sets: dict | None) -> bool | None:
    ids = [t["token_ids"] for t in token_sets if t is not None]
    return None if len(ids) < 2 else all(i == ids[0] for i in ids)


def kv_stayed_released(weights_woken: dict, kv_woken: dict, kv_bytes: int) -> bool:
    """After ``wake_up(["weights"])`` the KV cache was still released: ``wake_up(["kv_cache"])`` then brought back at
    least the KV cache's bytes (within ``TOLERANCE``)."""
    return kv_woken["used"] - weights_woken["used"] >= kv_bytes - TOLERANCE


def cycle_drift(cycles: Sequence[dict]) -> int | None:
    """The largest difference, in bytes, between memory in use after any wake of the cycles and after the first."""
    if not cycles:
        return None
    first = cycles[0]["after_wake"]["used"]
    return max(abs(c["after_wake"]["used"] - first) for c in cycles)


def handles_stable(cycles: Sequence[dict]) -> bool | None:
    """The driver holds as many mappings and reservations after every wake of the cycles as after the first, and no
    handle was left unreleased (``None``: legacy, no driver of ours)."""
    kvs = [c["after_wake"].get("kv") for c in cycles]
    if not kvs or any(k is None for k in kvs):
        return None
    keys = ("driver_mappings", "driver_reservations")
    return all(all(k[key] == kvs[0][key] for key in keys) and k["unreleased_handles"] == 0 for k in kvs)


def addresses_kept(readings: Sequence[dict]) -> bool:
    """Every reading shows the KV tensors at the same addresses (the extensible buffers' bases too)."""
    firsts = (readings[0]["kv_ptrs"], (readings[0].get("kv") or {}).get("bases"))
    return all((r["kv_ptrs"], (r.get("kv") or {}).get("bases")) == firsts for r in readings)


def case_row(result: dict) -> dict:
    """One summary row of a case file: the state (``complete``, ``refused``, ``failed in PHASE``, ``incomplete``) and
    the figures of the phases it ran."""
    case = result["case"]
    row: dict = {"case": case["id"], "model": case["model"], "runner": case["runner"], "mode": case["mode"]}
    if result.get("refused"):
        return row | {"state": "refused", "detail": result["refused"]}
    if result.get("error"):
        row |= {"state": f"failed in {result['error']['phase']}", "detail": result["error"]["error"]}
    else:
        row["state"] = "complete" if result.get("complete") else "incomplete"
    phases = result.get("phases", {})
    before = phases.get("before")
    if before is None:
        return row
    awake = before["memory"]
    row |= {
        "awake": awake["used"],
        "awake_smi": awake.get("nvidia_smi_used"),
        "kv_bytes": awake["kv_bytes"],
        "engine_seconds": result.get("engine_seconds"),
    }
    if (sw := phases.get("sleep_wake")) is not None:
        row |= {
            "asleep": sw["asleep"]["used"],
            "asleep_smi": sw["asleep"].get("nvidia_smi_used"),
            "woken": sw["woken"]["used"],
            "freed": awake["used"] - sw["asleep"]["used"],
            "sleep_s": sw["sleep_s"],
            "wake_s": sw["wake_s"],
            "tokens_after_wake": _same(before["tokens"], sw["tokens"]),
            "cached_after_wake": sum(n or 0 for n in sw["tokens"]["warm_cached_tokens"]),
        }
    if (wk := phases.get("weights_then_kv")) is not None:
        row |= {
            "kv_released_after_weights_wake": kv_stayed_released(
                wk["weights_woken"], wk["kv_woken"], awake["kv_bytes"]
            ),
            "extensible_released_flag": (wk["weights_woken"].get("kv") or {}).get("released"),
            "tokens_after_kv_wake": _same(before["tokens"], wk["tokens"]),
        }
    if (cy := phases.get("cycles")) is not None:
        rows = cy["cycles"]
        row |= {
            "cycles": len(rows),
            "cycle_sleep_median_s": _median([c["sleep_s"] for c in rows]),
            "cycle_wake_median_s": _median([c["wake_s"] for c in rows]),
            "cycle_drift": cycle_drift(rows),
            "handles_stable": handles_stable(rows),
            "tokens_after_cycles": _same(before["tokens"], cy["tokens"]),
        }
    if (l2 := phases.get("level2")) is not None:
        row |= {"level2_asleep": l2["asleep"]["used"], "level2_tokens": _same(before["tokens"], l2["tokens"])}
    readings = (
        [awake]
        + [r for r in (sw and sw.get("woken"), wk and wk.get("kv_woken")) if r]
        + [c["after_wake"] for c in (cy or {}).get("cycles", [])]
    )
    row["addresses_kept"] = addresses_kept(readings)
    return row


def pair_row(legacy: dict, extensible: dict) -> dict:
    """Extensible against legacy for one (model, runner), from two ``case_row`` rows and their case files' tokens:
    what sleep frees and what stays in use asleep, the ratio of the cycles' median wake times, and the checks."""
    row = {"pair": f"{legacy['model']}-{legacy['runner']}"}
    if "freed" not in legacy or "freed" not in extensible:
        return row | {"verdict": "not measured"}
    freed_diff = extensible["freed"] - legacy["freed"]
    asleep_diff = extensible["asleep"] - legacy["asleep"]
    lw, ew = legacy.get("cycle_wake_median_s"), extensible.get("cycle_wake_median_s")
    ratio = ew / lw if lw and ew is not None else None
    row |= {
        "freed_diff": freed_diff,
        "asleep_diff": asleep_diff,
        "wake_ratio": ratio,
        "freed_ok": freed_diff >= -TOLERANCE,
        "wake_ok": ratio is not None and ratio <= 1.0,
        "drift_ok": extensible.get("cycle_drift") is not None and extensible["cycle_drift"] <= TOLERANCE,
        "tokens_ok": all(
            extensible.get(k) is True for k in ("tokens_after_wake", "tokens_after_kv_wake", "tokens_after_cycles")
        ),
        "kv_released_ok": extensible.get("kv_released_after_weights_wake") is True,
        "handles_ok": extensible.get("handles_stable") is True,
    }
    checks = ("freed_ok", "wake_ok", "drift_ok", "tokens_ok", "kv_released_ok", "handles_ok", "tokens_vs_legacy")
    row["tokens_vs_legacy"] = extensible.get("tokens_before") is not None and extensible.get(
        "tokens_before"
    ) == legacy.get("tokens_before")
    row["verdict"] = "pass" if all(row[c] for c in checks) else "fail: " + ", ".join(c for c in checks if not row[c])
    return row


def summarize(results: Sequence[dict], skipped: Sequence[str] = ()) -> dict:
    """Rows per case, comparisons per (model, runner) with both modes measured, and the cases not run."""
    rows = []
    for r in results:
        row = case_row(r)
        before = r.get("phases", {}).get("before")
        row["tokens_before"] = before["tokens"]["token_ids"] if before else None
        rows.append(row)
    by_key = {(r["model"], r["runner"], r["mode"]): r for r in rows}
    pairs = [
        pair_row(by_key[(m, rn, "legacy")], by_key[(m, rn, "extensible")])
        for (m, rn, mode) in by_key
        if mode == "legacy" and (m, rn, "extensible") in by_key
    ]
    return {"cases": rows, "pairs": pairs, "skipped": list(skipped)}


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:+.0f}"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _flag(value: object) -> str:
    return {True: "yes", False: "NO", None: "-"}.get(value, str(value))


def render_table(summary: dict) -> str:
    """The summary as markdown: one table of cases, one of extensible-vs-legacy pairs, then what was skipped."""
    header = (
        "| case | state | awake GiB (smi) | asleep GiB (smi) | woken GiB | freed GiB | sleep s | wake s | "
        "cycles | median wake s | drift MiB | handles | KV released after weights wake | addresses | "
        "tokens after wake / kv wake / cycles / level 2 | cached after wake |"
    )
    lines = [header, "|" + " --- |" * 16]
    for r in summary["cases"]:
        if "awake" not in r:
            lines.append(f"| {r['case']} | {r['state']} | " + " | ".join(["-"] * 13) + f" | {r.get('detail', '')} |")
            continue
        tokens = " / ".join(
            _flag(r.get(k))
            for k in ("tokens_after_wake", "tokens_after_kv_wake", "tokens_after_cycles", "level2_tokens")
        )
        cells = [
            r["case"],
            r["state"],
            f"{_gib(r['awake'])} ({_gib(r.get('awake_smi'))})",
            f"{_gib(r.get('asleep'))} ({_gib(r.get('asleep_smi'))})",
            _gib(r.get("woken")),
            _gib(r.get("freed")),
            _secs(r.get("sleep_s")),
            _secs(r.get("wake_s")),
            r.get("cycles", "-"),
            _secs(r.get("cycle_wake_median_s")),
            _mib(r.get("cycle_drift")),
            _flag(r.get("handles_stable")),
            _flag(r.get("kv_released_after_weights_wake")),
            _flag(r.get("addresses_kept")),
            tokens,
            r.get("cached_after_wake", "-"),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    pairs = (
        "| model-runner | freed ext - legacy MiB | asleep ext - legacy MiB | wake ratio ext/legacy | "
        "tokens ext = legacy | verdict |"
    )
    lines += ["", pairs, "|" + " --- |" * 6]
    for p in summary["pairs"]:
        ratio = "-" if p.get("wake_ratio") is None else f"{p['wake_ratio']:.2f}"
        lines.append(
            f"| {p['pair']} | {_mib(p.get('freed_diff'))} | {_mib(p.get('asleep_diff'))} | {ratio} | "
            f"{_flag(p.get('tokens_vs_legacy'))} | {p['verdict']} |"
        )
    if summary["skipped"]:
        lines += ["", "Not run: " + "; ".join(summary["skipped"])]
    return "\n".join(lines) + "\n"


# -- the driver of the cases ---------------------------------------------------------------------------------------
def _compile_cache_env() -> None:
    """The compile caches under ``EXTENSIBLE_KV_COMPILE_CACHE`` when it is set (as ``ci/gpu_matrix.sh`` does): the
    second engine of a (model, runner) then loads what the first compiled."""
    root = os.environ.get("EXTENSIBLE_KV_COMPILE_CACHE")
    if root:
        for name, sub in (
            ("VLLM_CACHE_ROOT", "vllm"),
            ("TRITON_CACHE_DIR", "triton"),
            ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ):
            os.environ.setdefault(name, str(Path(root) / sub))


def read_case(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_process(case: Case, out: Path, timeout: float) -> str | None:
    """Run ``case`` in a fresh process (its own session, so a timeout stops everything it started); ``None`` when it
    exited 0, else why not."""
    log = out / f"{case.id}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), str(out), "--case", case.id]
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT / "reference"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    )
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timed out after {timeout:.0f} s"
    return None if rc == 0 else f"exit {rc} after {time.monotonic() - start:.0f} s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python integration/sleep_mode.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output folder")
    p.add_argument("--only", nargs="*", help="case id patterns (fnmatch or substring)")
    p.add_argument("--budget-seconds", type=float, default=390.0, help="start no case whose estimate does not fit")
    p.add_argument("--list", action="store_true", help="print the cases (and whether each is done) and exit")
    p.add_argument("--case", help="run this one case in this process (what the driver starts)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _compile_cache_env()
    if args.case:
        cases = {c.id: c for c in CASES}
        if args.case not in cases:
            raise SystemExit(f"--case {args.case!r}: expected one of {sorted(cases)}")
        result = run_one(cases[args.case], out / f"{args.case}.json")
        return 0 if result.get("complete") or result.get("refused") else 1
    chosen = select(CASES, args.only)
    if args.list:
        for c in chosen:
            done = (read_case(out / f"{c.id}.json") or {}).get("complete", False)
            print(f"{c.id}\t~{c.seconds} s\t{'done' if done else 'to run'}")
        return 0
    deadline = time.monotonic() + args.budget_seconds
    skipped, failures = [], {}
    for c in chosen:
        previous = read_case(out / f"{c.id}.json")
        if previous is not None and (previous.get("complete") or previous.get("refused")):
            continue
        left = deadline - time.monotonic()
        if left < c.seconds:
            skipped.append(f"{c.id} (budget: {left:.0f} s left, about {c.seconds} s needed)")
            continue
        print(f"{c.id} ...", flush=True)
        if (why := run_process(c, out, min(c.timeout, left))) is not None:
            failures[c.id] = why
    results = []
    for c in chosen:
        r = read_case(out / f"{c.id}.json")
        if c.id in failures and (r is None or not (r.get("complete") or r.get("refused") or r.get("error"))):
            ran = list((r or {}).get("phases", {}))
            phase = PHASES[len(ran)] if len(ran) < len(PHASES) else "the end"
            r = (r or {"case": asdict(c) | {"id": c.id}}) | {"error": {"phase": phase, "error": failures[c.id]}}
        if r is not None:
            results.append(r)
    summary = summarize(results, skipped)
    write_json(out / "summary.json", summary)
    table = render_table(summary)
    (out / "table.md").write_text(table)
    try:
        from extensible_kv import record

        record.write(out / "environment.json", record.environment())
    except Exception as exc:  # the environment is context, not a result
        print(f"environment.json not written: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
