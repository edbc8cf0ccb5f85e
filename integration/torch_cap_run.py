"""torch's caching allocator under the worker's cap (``WorkerKV.hold_torch_to_budget``), on a GPU, driven by seeded
random allocation sequences that nobody tuned: how far its reserve goes past the cap, with the cap and without it,
and whether the cap ever refuses what the live tensors need.

    python -m integration.torch_cap_run OUT [--seeds 8] [--steps 4000] [--live-mib 512] [--headroom-mib 64]

Each seed runs twice in a fresh process (``one``). A run first allocates and frees a warm set (the worst batches'
segments, cached), then ``capped`` does exactly what the worker does after its final commit (expandable segments,
the cache emptied, and ``worker_kv.trim_to`` the cap after every served step of ``--step-actions`` actions);
``free`` sets nothing. The cap
is what is live then plus the most the live tensors can reach (``--live-mib`` plus one largest tensor) plus
``--headroom-mib``, in both modes (``free`` keeps the warm set cached, as an uncapped engine keeps the worst
batches'): the cap the worker derives leaves the worst batches' growth the same way. Then ``--steps`` steps
each allocate a tensor of a log-uniform size (4 KiB to 256 MiB) or free a random live one, the live bytes kept
under ``--live-mib`` before each allocation. Recorded per run: the cap, the highest reserve and its excess over the
cap, the steps that ended over it, at each of those the reserved bytes in segments holding live tensors but unused
(stranded), and any out-of-memory error with the live bytes at that moment (the cap refusing what fits under it).

Writes ``OUT/torch-cap-summary.json`` (runs, and per seed capped against free) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20
LARGEST = 256 * MIB  # the largest tensor a step allocates


def stranded(device: int) -> int:
    """Bytes reserved but unused in default-pool segments that hold a live block (the collection frees only whole
    unused segments)."""
    import torch

    from extensible_kv.vllm.sizing import default_pool

    live = [s for s in default_pool(torch.cuda.memory_snapshot(), device) if int(s["active_size"]) > 0]
    return sum(int(s["total_size"]) - int(s["active_size"]) for s in live)


def one(seed: int, mode: str, steps: int, live_limit: int, headroom: int, step_actions: int) -> dict:
    import torch

    from extensible_kv.vllm import worker_kv

    rng = random.Random(seed)
    device = torch.cuda.current_device()
    warm = [torch.empty(rng.randrange(1, 256) * MIB, dtype=torch.uint8, device="cuda") for _ in range(12)]
    del warm  # the worst batches' segments, cached and unused
    if mode == "capped":  # exactly what WorkerKV.hold_torch_to_budget does
        worker_kv._allocator_settings("expandable_segments:True")
        torch.cuda.empty_cache()
    reserved = int(torch.cuda.memory_reserved())
    cap = int(torch.cuda.memory_allocated()) + live_limit + LARGEST + headroom  # the same number in both modes
    torch.cuda.reset_peak_memory_stats()
    live: list = []
    live_bytes = 0
    over_steps: list[dict] = []
    errors: list[str] = []
    trims = 0
    for step in range(steps):
        if mode == "capped" and step % step_actions == 0 and worker_kv.trim_to(cap) is not None:
            trims += 1  # after every served step, as WorkerKV.trim_torch_cache
        if live and (rng.random() < 0.45 or live_bytes > live_limit):
            t = live.pop(rng.randrange(len(live)))
            live_bytes -= t.numel()
            del t
        else:
            size = int(math.exp(rng.uniform(math.log(4096), math.log(LARGEST))))
            try:
                live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
                live_bytes += size
            except torch.OutOfMemoryError as exc:
                errors.append(
                    f"step {step}: asked {size} B with {live_bytes} B live, "
                    f"{int(torch.cuda.memory_reserved())} B reserved: {str(exc).splitlines()[0]}"
                )
                break
        now = int(torch.cuda.memory_reserved())
        if now > cap and len(over_steps) < 50:
            over_steps.append(
                {
                    "step": step,
                    "over": now - cap,
                    "allocated": int(torch.cuda.memory_allocated()),
                    "stranded": stranded(device),
                }
            )
    peak = int(torch.cuda.max_memory_reserved())
    return {
        "seed": seed,
        "mode": mode,
        "steps": steps,
        "cap": cap,
        "reserved_at_start": reserved,
        "peak_reserved": peak,
        "peak_over_cap": peak - cap,
        "peak_allocated": int(torch.cuda.max_memory_allocated()),
        "steps_over_cap": len(over_steps),
        "trims": trims,
        "over": over_steps,
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m integration.torch_cap_run")
    p.add_argument("out", nargs="?")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--live-mib", type=int, default=512)
    p.add_argument("--headroom-mib", type=int, default=64)
    p.add_argument("--step-actions", type=int, default=16)
    p.add_argument("--one", nargs=2, metavar=("SEED", "MODE"))
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(one(int(a.one[0]), a.one[1], a.steps, a.live_mib * MIB, a.headroom_mib * MIB, a.step_actions)))
        return 0
    out = Path(a.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in range(a.seeds):
        for mode in ("capped", "free"):
            args = [
                sys.executable,
                "-m",
                "integration.torch_cap_run",
                "--one",
                str(seed),
                mode,
                "--steps",
                str(a.steps),
            ]
            args += ["--live-mib", str(a.live_mib), "--headroom-mib", str(a.headroom_mib)]
            args += ["--step-actions", str(a.step_actions)]
            done = subprocess.run(args, capture_output=True, text=True, timeout=300)
            if done.returncode:
                runs.append({"seed": seed, "mode": mode, "errors": [done.stderr[-2000:]]})
            else:
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    lines = [
        "| seed | mode | cap MiB | peak reserved MiB | over cap MiB | steps over | most stranded MiB | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        most = max((o["stranded"] for o in r.get("over") or ()), default=0)
        lines.append(
            f"| {r['seed']} | {r['mode']} | {r.get('cap', 0) / MIB:.0f} | {r.get('peak_reserved', 0) / MIB:.0f} | "
            f"{r.get('peak_over_cap', 0) / MIB:+.0f} | {r.get('steps_over_cap')} | {most / MIB:.0f} | "
            f"{len(r['errors'])} |"
        )
    capped = [r for r in runs if r["mode"] == "capped"]
    summary = {
        "args": vars(a),
        "runs": runs,
        "capped_errors": sum(len(r["errors"]) for r in capped),
        "capped_peak_over_cap": max((r.get("peak_over_cap", 0) for r in capped), default=None),
        "free_peak_over_cap": max((r.get("peak_over_cap", 0) for r in runs if r["mode"] == "free"), default=None),
        "table": "\n".join(lines),
    }
    (out / "torch-cap-summary.json").write_text(json.dumps(summary, indent=1))
    print(summary["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
