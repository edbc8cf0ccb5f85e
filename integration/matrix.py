"""The GPU matrix of vLLM parity cases: every engine in a fresh ``run_case`` process with a timeout, every case JSON and
log under ``OUT/integration/``, a compact table at the end (also ``OUT/table.md``), the throughput pair as
pytest-benchmark JSON (``OUT/serving-throughput-<model>-<runner>.json``). ``OUT`` is a run folder the report reads
as it is (``python -m extensible_kv report OUT``).

    python -m integration.matrix OUT [--only PATTERN ...] [--part N/M] [--budget-seconds S] [--list]

Resumable: a run whose JSON exists is read, not rerun, and the table is rebuilt from every JSON present, so the same
command can be repeated in several device calls (keep ``OUT`` inside the working tree, untracked and not ignored,
so it travels to the device with each call) until every case has run. ``--budget-seconds`` stops starting runs
that would not finish in time; ``--part N/M`` takes the N-th of M contiguous slices of the (filtered) case list.
The cases are ordered most informative first.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extensible_kv_lab.parity import refusal  # on the path once integration.parity is imported
from extensible_kv_lab.report.serving import start_state
from integration.parity import (
    THROUGHPUT_ORDER,
    Case,
    Throughput,
    compiled,
    measured,
    measured_pairs,
    row,
    run_parity,
    run_subprocess,
    run_throughput,
    table,
    throughput_benchmark,
    throughput_pair,
)

# Shapes. Qwen3-0.6B: 8 sequences of up to 2,048 prompt tokens fill vLLM's 16,384 batched tokens (the peak batch).
QWEN = dict(model="qwen3-0.6b-shape", max_model_len=4096, max_num_seqs=8, seconds=75, timeout=300)
SWA = dict(model="tiny-llama-swa", max_model_len=2048, max_num_seqs=8, seconds=60, timeout=300)
# A Qwen2-VL shape (576 tokens per image): 8 prompts of 2,048 tokens, one image each, fill the 16,384 batched tokens;
# the encoder cache holds 16,384 // 576 = 28 images (run_case fills it before the peak batch).
MM = dict(model="tiny-mm", max_model_len=4096, max_num_seqs=8, seconds=75, timeout=300)
# Qwen3-0.6B shape with ngram speculation, 4 drafts: the widest step is S x 5 logits rows x 151,936 vocab.
SPEC = dict(QWEN, speculative="ngram:4", seconds=90)
# Llama-3-8B at 256 sequences and vLLM's default CUDA graph capture sizes for them (up to 512), 8K context.
# Per run 75 s: on the H200 its three runs took 147 s with the compile cache warm.
LLAMA_8B = dict(model="llama-8b-shape", max_model_len=8192, max_num_seqs=256, capture_sizes="", seconds=75, timeout=540)


def _cases() -> list:
    cases: list = [
        # 1. The model at a real peak, bf16 then fp8 (whose baseline was seen nondeterministic).
        Case(runner="v1", **QWEN, group="qwen"),
        Case(runner="v1", kv_cache_dtype="fp8", **QWEN, group="qwen"),
        # 2. Interleaved sliding-window and full attention: two KV cache groups sharing every buffer.
        Case(runner="v1", **SWA, group="swa"),
        Case(runner="v2", **SWA, group="swa"),
        Case(runner="v2", **QWEN, group="qwen"),
        Case(runner="v2", kv_cache_dtype="fp8", **QWEN, group="qwen"),
        Case(runner="v1", kv_cache_dtype="fp8", **SWA, group="swa"),
        Case(runner="v2", kv_cache_dtype="fp8", **SWA, group="swa"),
        # 3. Memory no profile sees: the multimodal encoder cache held full at the peak ...
        *(Case(runner=r, **MM, group="mm") for r in ("v1", "v2")),
        # ... and speculative decoding's widest step (V2 refuses ngram in vLLM 0.26.0: a refused combination, fast);
        # at 64 sequences the sampler term is 64 x 5 = 320 rows x 151,936.
        Case(runner="v1", **SPEC, group="spec"),
        Case(runner="v2", **(SPEC | {"seconds": 30}), group="spec"),
        Case(
            runner="v1", **(SPEC | {"max_num_seqs": 64, "variant": "s64", "seconds": 110, "timeout": 360}), group="spec"
        ),
    ]
    # 4. Block sizes (FLASH_ATTN takes any multiple of 16).
    for block in (32, 64):
        for runner in ("v1", "v2"):
            cases.append(Case(runner=runner, block_size=block, **QWEN, group="blocks"))
    for runner in ("v1", "v2"):
        cases.append(Case(runner=runner, kv_cache_dtype="fp8", block_size=32, **QWEN, group="blocks"))
        cases.append(Case(runner=runner, block_size=32, **SWA, group="blocks"))
    cases.append(Case(runner="v1", backend="TRITON_ATTN", **QWEN, group="blocks"))
    cases.append(Case(runner="v2", backend="TRITON_ATTN", **QWEN, group="blocks"))
    # 5. The 8B shape at 256 sequences, default capture sizes.
    cases += [Case(runner=r, **LLAMA_8B, group="8b") for r in ("v1", "v2")]
    # 6. Serving speed at the same block count: 256 sequences x 576 tokens need 9,216 16-token blocks.
    cases += [Throughput("llama-8b-shape", r, num_gpu_blocks_override=16384) for r in ("v2", "v1")]
    return cases


CASES = _cases()


def select(cases: list, only: list[str] | None, part: str | None) -> list:
    """Cases matching any ``only`` pattern (a group name: that group; a case id: that case alone; else an fnmatch
    pattern or a substring of the case id), then the ``part`` N/M slice."""
    if only:
        groups, ids = {c.group for c in cases}, {c.id for c in cases}

        def matches(p: str, c) -> bool:
            if p in groups:
                return p == c.group
            return p == c.id if p in ids else fnmatch.fnmatch(c.id, p) or p in c.id

        def hit(c) -> bool:
            return any(matches(p, c) for p in only)

        cases = [c for c in cases if hit(c)]
    if part:
        n, m = (int(x) for x in part.split("/"))
        if not 1 <= n <= m:
            raise SystemExit(f"--part {part}: expected N/M with 1 <= N <= M")
        size = -(-len(cases) // m)
        cases = cases[(n - 1) * size : n * size]
    return cases


def estimate_seconds(case) -> int:
    """Expected wall time of a case with every run still to do (three runs for a parity case, four for
    throughput)."""
    return case.seconds * (len(THROUGHPUT_ORDER) if isinstance(case, Throughput) else case.baseline_runs + 1)


class Clock:
    """Timeouts for runs within an overall budget: ``None`` once a run's expected time no longer fits."""

    def __init__(self, seconds: float | None, now=time.monotonic) -> None:
        self.now = now
        self.deadline = None if seconds is None else now() + seconds

    def __call__(self, expected: int) -> int | None:
        if self.deadline is None:
            return expected * 10
        left = self.deadline - self.now()
        return None if left < expected else int(left)


def rows_from_files(cases: list, cases_dir: Path) -> tuple[list[dict], dict]:
    """Table rows from the JSONs present (nothing runs); the throughput pairs by case id."""

    def read(name: str, _args, _timeout, _cut) -> dict | None:
        path = cases_dir / f"{name}.json"
        err = cases_dir / f"{name}.error.txt"
        if path.exists():
            try:
                return json.loads(path.read_text())
            except ValueError as exc:  # cut short by a killed call: the table says so, and a rerun replaces it
                return {"error": f"{path.name} is not JSON ({exc})"}
        return {"error": err.read_text().strip()} if err.exists() else None

    rows, pairs = [], {}
    for case in cases:
        if isinstance(case, Throughput):
            pairs[case.id] = throughput_pair(
                lambda mode, repeat, case=case: read(case.run_name(mode, repeat), None, None, False)
            )
        else:
            rows.append(row(case, run_parity(case, read)))
    return rows, pairs


def _state(run: dict | None) -> str:
    """Why a throughput run has no figures: not run, its error, vLLM's refusal, or built without measuring."""
    if not run:
        return "not run"
    if measured(run):
        return "measured"
    return run["error"] if "error" in run else refusal(run) or "built, no throughput"


def throughput_lines(pairs: dict, out: Path) -> list[str]:
    """One line per throughput case (its runs by mode, in pairing order), writing ``serving-<id>.json`` for each
    case with at least one pair measured on both sides."""
    lines = []
    for cid, runs in pairs.items():
        legacy, ext = measured_pairs(runs)
        if not legacy:
            state = "; ".join(f"{m}: {_state(r[0])}" for m, r in runs.items())
            lines.append(f"- {cid}: {state}")
            continue
        try:
            bench = throughput_benchmark(legacy, ext)
        except ValueError as exc:  # windows that do not pair: said, and the rest of the table still written
            lines.append(f"- {cid}: not compared: {exc}")
            continue
        path = out / f"serving-{cid}.json"
        path.write_text(json.dumps(bench, indent=2))
        r = bench["ratio"]
        low, high = r["decode_range"]
        start = (
            f"ratio {r['engine_seconds']:.2f}"
            if r["engine_seconds_comparable"]
            else f"no ratio: {start_state(compiled(legacy[-1]))} (legacy), "
            f"{start_state(compiled(ext[-1]))} (extensible)"
        )
        rates = [b["extra_info"]["tokens_per_s"] for b in bench["benchmarks"]]  # legacy, extensible
        lines.append(
            f"- {cid}: decode {rates[1]:.0f} vs {rates[0]:.0f} tokens/s, extensible/legacy "
            f"{r['decode_tokens_per_s']:.3f} (median of {len(r['decode_window_ratios'])} paired windows "
            f"from {r['pairs']} pair{'s' * (r['pairs'] > 1)}, {low:.3f} to {high:.3f}; target >= 0.99), "
            f"engine start {ext[-1]['engine_seconds']:.1f} vs {legacy[-1]['engine_seconds']:.1f} s "
            f"({start}), blocks {legacy[-1]['memory']['num_gpu_blocks']} / "
            f"{ext[-1]['memory']['num_gpu_blocks']}; {path.name}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m integration.matrix", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output run folder (integration/, table.md, serving-*.json)")
    p.add_argument(
        "--only", nargs="*", help="case ids or groups (qwen, swa, mm, spec, blocks, 8b, throughput); fnmatch ok"
    )
    p.add_argument("--part", help="N/M: the N-th of M contiguous slices of the selected cases")
    p.add_argument(
        "--budget-seconds",
        type=float,
        default=None,
        help="start no run that would not finish within this many seconds from now",
    )
    p.add_argument("--retry-failed", action="store_true", help="rerun runs that failed or timed out before")
    p.add_argument("--list", action="store_true", help="list the selected cases and their estimates; run nothing")
    p.add_argument("--table-only", action="store_true", help="rebuild the table from the JSONs present")
    args = p.parse_args(argv)
    selected = select(CASES, args.only, args.part)
    if args.list:
        for c in selected:
            print(f"{c.id:60s} {c.group:10s} ~{estimate_seconds(c) / 60:.1f} min")
        print(f"{len(selected)} cases, ~{sum(map(estimate_seconds, selected)) / 60:.0f} min if nothing has run yet")
        return 0
    out = Path(args.out)
    cases_dir = out / "integration"
    cases_dir.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        clock = Clock(args.budget_seconds)

        def runner(name: str, run_args: list[str], timeout: int, budget_cut: bool) -> dict | None:
            print(f"[{time.strftime('%H:%M:%S')}] {name} (timeout {timeout} s)", flush=True)
            return run_subprocess(
                cases_dir, name, run_args, timeout, budget_cut=budget_cut, retry_failed=args.retry_failed
            )

        for case in selected:
            if isinstance(case, Throughput):
                run_throughput(case, runner, budget=clock)
            else:
                run_parity(case, runner, budget=clock)
    rows, pairs = rows_from_files(CASES, cases_dir)
    done = [r for r in rows if r["outcome"] != "not run"]
    text = table(done or rows) + "\n" + "\n".join(throughput_lines(pairs, out))
    (out / "table.md").write_text(text + "\n")
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    left = [
        c.id
        for c in selected
        if any(r["case"] == c.id and r["outcome"] == "not run" for r in rows)
        or c.id in pairs
        and None in pairs[c.id]["legacy"] + pairs[c.id]["extensible"]
    ]
    print(text)
    if left:
        print(f"\n{len(left)} selected case(s) not run yet (time budget): run the same command again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
