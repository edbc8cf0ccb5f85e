"""An adversarial load for a vLLM engine, and the highest device memory it reached against the engine's budget.

    python -m integration.load_generator --list --max-model-len 512 --max-num-seqs 32 --batches 200   # CPU: the plan

``plan(shape, seed, batches, sleep_every)`` draws seeded bursts of requests, cycling through extreme kinds and
random mixes: prompts of max_model_len - 1 tokens, decodes to max_model_len, shared prefixes (prefix-cache hits, then
short chunks over long contexts), the same prompts again (whole-prompt hits), long prompts run twice (the first pass
fills the prefix cache, the second prefills short chunks over it: the load that put the DeepSeek-V2 MLA shape over
its budget), many more requests than max_num_seqs with long outputs (preemption pressure), single tokens, random
mixes; with ``sleep_every`` a sleep/wake cycle before every that many bursts. Pure Python: no vLLM, no torch.

``drive(llm, bursts)`` runs them on any engine (a vLLM ``LLM``: legacy, extensible, vLLM's native path), step by
step (``llm_engine.add_request`` / ``step``), and reads after every step, in the worker, the device memory used since
the worker started against the budget, as ``integration/parity.py`` Note [Over budget at the measured peak] defines
it (the free reading less what torch reserved during the step and gave back before the reading). It reports the
highest reading, the step that reached it (its scheduled tokens, requests and their cached context) and the burst.

This module never imports the sizing (``extensible_kv.vllm``): what it measures must not depend on what it tests.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, field

KINDS = (
    "max_len_prompts",
    "decode_to_max_len",
    "shared_prefix",
    "cached_prefix_new_chunks",
    "repeat",
    "long_prompts_twice",
    "preemption",
    "single_tokens",
    "random_mix",
)


@dataclass(frozen=True)
class Shape:
    """The engine's limits the load is drawn for."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab: int  # token ids are drawn from [3, vocab)


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class Burst:
    """Requests submitted together (``passes`` times: a second pass reads the first's prefix cache), after a
    sleep/wake cycle of ``sleep_level`` where set."""

    index: int
    kind: str
    requests: list[Request]
    passes: int = 1
    sleep_level: int | None = None

    def summary(self) -> dict:
        lens = [len(r.prompt) for r in self.requests]
        outs = [r.max_tokens for r in self.requests]
        return {
            "index": self.index,
            "kind": self.kind,
            "requests": len(self.requests),
            "passes": self.passes,
            "sleep_level": self.sleep_level,
            "prompt_len_max": max(lens, default=0),
            "prompt_tokens": sum(lens),
            "max_tokens_max": max(outs, default=0),
        }


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _burst(kind: str, rng: random.Random, s: Shape, history: list[Burst], out: int) -> tuple[list[Request], int]:
    """The requests of one burst of ``kind`` and how many passes it runs; outputs are at most ``out`` tokens except
    where the kind is about decoding (each burst's steps are its prefill chunks plus its longest output)."""
    L, S, V = s.max_model_len, s.max_num_seqs, s.vocab
    out = max(1, min(out, L - 1))
    if kind == "max_len_prompts":  # the longest prompts, one token out
        return [Request(_tokens(rng, L - 1, V), 1) for _ in range(S)], 1
    if kind == "decode_to_max_len":  # every sequence decoding up to max_model_len
        m = rng.randint(1, out)
        return [Request(_tokens(rng, L - m, V), m) for _ in range(S)], 1
    if kind == "shared_prefix":  # one long prefix, short distinct suffixes: cache hits, short chunks at long context
        prefix = _tokens(rng, rng.randint(max(1, L // 2), max(1, L - 9)), V)
        reqs = []
        for _ in range(S):
            tail = _tokens(rng, rng.randint(min(1, L - 1 - len(prefix)), max(0, min(8, L - 1 - len(prefix)))), V)
            reqs.append(Request(prefix + tail, rng.randint(1, max(1, min(out, L - len(prefix) - len(tail))))))
        return reqs, 1
    if kind == "cached_prefix_new_chunks":  # a cached prefix, then new chunks of any length up to the rest
        prefix = _tokens(rng, rng.randint(max(1, L // 4), max(1, L // 2)), V)
        room = L - 1 - len(prefix)
        reqs = [Request(prefix + _tokens(rng, rng.randint(min(1, room), room), V), 1) for _ in range(S)]
        return reqs, 2  # the first pass caches the prefix, the second prefills every chunk over it
    if kind == "repeat" and history:  # an earlier burst's prompts again: whole-prompt hits
        earlier = rng.choice(history)
        return [Request(list(r.prompt), r.max_tokens) for r in earlier.requests], 1
    if kind == "long_prompts_twice":  # long prompts, run twice: the second pass prefills over the cached context
        n = min(L - 1, max(2, int(L * rng.uniform(0.7, 0.95))))
        return [Request(_tokens(rng, n, V), rng.randint(1, max(1, min(out, L - n)))) for _ in range(S)], 2
    if kind == "preemption":  # far more requests than sequences, the longest outputs the box allows
        reqs = []
        for _ in range(4 * S):
            m = rng.randint(1, out)
            reqs.append(Request(_tokens(rng, rng.randint(max(1, L // 2), L - m), V), m))
        return reqs, 1
    if kind == "single_tokens":
        return [Request(_tokens(rng, 1, V), rng.randint(1, out)) for _ in range(S)], 1
    # random_mix (and repeat with nothing to repeat)
    reqs = []
    for _ in range(rng.randint(1, 2 * S)):
        n = rng.choice([1, rng.randint(1, L - 1), L - 1, rng.randint(max(1, L - 32), L - 1)])
        reqs.append(Request(_tokens(rng, n, V), rng.randint(1, max(1, min(L - n, out)))))
    return reqs, rng.choice([1, 1, 2])


def plan(shape: Shape, seed: int, batches: int, sleep_every: int | None = None, max_out: int = 8) -> list[Burst]:
    """``batches`` seeded bursts: every kind in ``KINDS`` in the first ``len(KINDS)``, then drawn at random;
    outputs of at most ``max_out`` tokens (``decode_to_max_len`` still ends every sequence at max_model_len)."""
    if shape.max_model_len < 2 or shape.max_num_seqs < 1 or shape.vocab < 4:
        raise ValueError(f"no load fits {shape}: max_model_len >= 2, max_num_seqs >= 1 and vocab >= 4 needed")
    rng = random.Random(seed)
    bursts: list[Burst] = []
    for i in range(batches):
        kind = KINDS[i] if i < len(KINDS) else rng.choice(KINDS)
        requests, passes = _burst(kind, rng, shape, bursts, max_out)
        sleep = rng.choice([1, 2]) if sleep_every and i and i % sleep_every == 0 else None
        bursts.append(Burst(i, kind, requests, passes, sleep))
    for b in bursts:
        for r in b.requests:
            if not 1 <= len(r.prompt) <= shape.max_model_len - 1 or len(r.prompt) + r.max_tokens > shape.max_model_len:
                raise AssertionError(f"burst {b.index} ({b.kind}): a request of {len(r.prompt)} + {r.max_tokens}")
    return bursts


# -- on the engine (GPU) -------------------------------------------------------------------------------------------
def _recorder_start(worker, trace: bool = False) -> None:
    """In the worker: record every step's shape and restart torch's peak statistics; with ``trace``, torch's
    allocation history too (``memory_trace``: the readings replay the step that allocated the most so far)."""
    import torch

    original = worker.execute_model
    worker._load_steps = []
    worker._load_trace = trace
    if trace:
        from integration import memory_trace

        worker._load_traced_top = getattr(worker, "_load_traced_top", 0)
        memory_trace.open_window()

    def execute_model(scheduler_output, *args, **kwargs):
        new = getattr(scheduler_output, "scheduled_new_reqs", None) or []
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        contexts = [int(r.num_computed_tokens) for r in new]
        contexts += [int(c) for c in (getattr(cached, "num_computed_tokens", None) or [])]
        worker._load_steps.append(
            {
                "tokens": int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0),
                "requests": len(getattr(scheduler_output, "num_scheduled_tokens", None) or {}),
                "context_max": max(contexts, default=0),
                "context_sum": sum(contexts),
                "new_requests": len(new),
            }
        )
        return original(scheduler_output, *args, **kwargs)

    worker.execute_model = execute_model
    worker._load_original = original
    torch.cuda.reset_peak_memory_stats()


def _reading(worker) -> dict:
    """In the worker: memory used since it started, less the budget, at the peak since the last reading (Note
    [Over budget at the measured peak] in ``integration/parity.py``); the steps since then."""
    import torch

    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    released = max(0, torch.cuda.max_memory_reserved() - torch.cuda.memory_reserved())
    used = int(worker.init_snapshot.free_memory) - (int(free) - released)
    steps, worker._load_steps = worker._load_steps, []
    peak_allocated, peak_reserved = int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())
    torch.cuda.reset_peak_memory_stats()
    trace = None
    if worker._load_trace:
        from integration import memory_trace

        if peak_allocated > worker._load_traced_top:
            worker._load_traced_top = peak_allocated
            trace = memory_trace.close_window()
        memory_trace.open_window()
    return {
        "trace": trace,  # the replay of the steps since the last reading, where they allocated the most so far
        "over_budget": used - int(worker.requested_memory),
        "used": used,
        "torch_reserved": int(torch.cuda.memory_reserved()),
        "torch_allocated": int(torch.cuda.memory_allocated()),
        "peak_allocated": peak_allocated,  # live tensors at the step's peak: above the worst batches' is a batch
        "peak_reserved": peak_reserved,  # reserved well above peak_allocated: the allocator's cache, not a batch
        "released": released,
        "steps": steps,
    }


def _recorder_stop(worker) -> None:
    worker.execute_model = worker._load_original
    if worker._load_trace:
        from integration import memory_trace

        memory_trace.stop()
    del worker._load_original, worker._load_steps, worker._load_trace


@dataclass
class Report:
    seed: int
    bursts: int = 0
    steps: int = 0
    sleep_cycles: int = 0
    highest_over_budget: int | None = None
    highest: dict | None = None
    highest_allocated: dict | None = None  # the step with the most live tensors: a batch, not the allocator's cache
    per_kind: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)


def drive(
    llm, bursts: list[Burst], seed: int, deadline: float | None = None, prompt_of=None, trace: bool = False
) -> Report:
    """Run ``bursts`` on ``llm`` step by step, reading memory after every step; stop early at ``deadline``
    (``time.monotonic()``). ``prompt_of(request, name)``: the vLLM prompt of a request (default: its token ids; a
    multimodal case attaches images). ``trace``: the step with the most allocated carries what was live at its
    peak and where it was allocated (``highest_allocated['trace']``, ``memory_trace.peak_of``)."""
    import time
    from functools import partial

    from vllm import SamplingParams

    engine = llm.llm_engine
    report = Report(seed)
    start = partial(_recorder_start, trace=trace)
    llm.collective_rpc(start)
    try:
        for burst in bursts:
            if deadline is not None and time.monotonic() > deadline:
                report.errors.append(f"stopped at burst {burst.index}: time box")
                break
            if burst.sleep_level is not None:
                llm.collective_rpc(_recorder_stop)
                llm.sleep(level=burst.sleep_level)
                llm.wake_up()
                llm.collective_rpc(start)
                report.sleep_cycles += 1
            for p in range(burst.passes):
                for j, r in enumerate(burst.requests):
                    params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, detokenize=False)
                    name = f"b{burst.index}p{p}r{j}"
                    prompt = prompt_of(r, name) if prompt_of is not None else {"prompt_token_ids": r.prompt}
                    engine.add_request(name, prompt, params)
                while engine.has_unfinished_requests():
                    engine.step()
                    reading = llm.collective_rpc(_reading)[0]
                    traced = reading.pop("trace", None)
                    report.steps += 1
                    over = reading["over_budget"]
                    kind = report.per_kind.setdefault(burst.kind, {"bursts": set(), "highest_over_budget": None})
                    kind["bursts"].add(burst.index)
                    if kind["highest_over_budget"] is None or over > kind["highest_over_budget"]:
                        kind["highest_over_budget"] = over
                    top = report.highest_allocated
                    if top is None or reading["peak_allocated"] > top["peak_allocated"]:
                        report.highest_allocated = {
                            "peak_allocated": reading["peak_allocated"],
                            "burst": burst.summary(),
                            "pass": p,
                            "steps": reading["steps"],
                            "trace": traced,
                        }
                    if report.highest_over_budget is None or over > report.highest_over_budget:
                        report.highest_over_budget = over
                        report.highest = {"burst": burst.summary(), "pass": p, "reading": reading}
            report.bursts += 1
    finally:
        llm.collective_rpc(_recorder_stop)
    for kind in report.per_kind.values():
        kind["bursts"] = len(kind["bursts"])
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m integration.load_generator")
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, required=True)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep-every", type=int, default=None)
    p.add_argument("--max-out", type=int, default=8)
    p.add_argument("--list", action="store_true", help="print the bursts' summaries as JSON lines")
    args = p.parse_args(argv)
    shape = Shape(args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens, args.vocab)
    for b in plan(shape, args.seed, args.batches, args.sleep_every, args.max_out):
        print(json.dumps(b.summary()))
    return 0


def report_dict(report: Report) -> dict:
    return asdict(report)


if __name__ == "__main__":
    sys.exit(main())
