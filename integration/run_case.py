"""One vLLM 0.26.0 case in this process: build an engine (legacy or extensible KV cache), generate greedily, and
write token ids and memory figures as JSON.

    python -m integration.run_case --model tiny-llama --runner v2 --backend FLASH_ATTN --mode extensible \
        --out reports/out/integration/case.json [--kv-cache-dtype fp8] [--block-size 32] [--corrupt] \
        [--no-peak] [--throughput --num-gpu-blocks-override 16384] [--batch-invariant] [--dry-run]

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the extensible patches and the KV checks apply
to the worker directly. Weights come from the dummy loader and are then re-initialised in place from a seeded normal
(the dummy loader's +-1e-3 weights make tokens insensitive to the KV cache). Prompts are token ids.

In order, after the engine is built:

1. ``extensible_kv_report`` (after the ``extensible_kv_cache()`` block has exited: Note [An engine keeps its RPCs])
   and the memory figures after warmup and the final commit (``memory``).
2. The generation runs twice over the same prompts: a one-token pass fills the prefix cache, then the measured pass
   reads those cached KV blocks (``token_ids``). ``--corrupt`` overwrites every committed KV block between the two
   passes, which must change the tokens.
3. ``--throughput``: steady-state decode tokens/s (``throughput``; ``integration.parity`` turns a legacy and an
   extensible run into pytest-benchmark JSON).
4. ``--peak`` (default): the peak-shaped batch, ``max_num_batched_tokens`` prompt tokens over ``max_num_seqs``
   sequences with ``max_tokens=1``, then device memory used since the worker started against the budget
   (``memory.peak``; the definition is Note [Over budget at the measured peak] in ``integration/parity.py``).
5. ``--sensitivity`` (default): every committed KV block is overwritten and the measured pass runs again; its tokens
   must differ from step 2's (``sensitivity``): the parity comparison can fail.

An engine that vLLM (or the extensible path) refuses to build for this combination writes ``refused`` (the
exception's text) instead and exits 0, so a matrix goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

if __package__ in (None, ""):  # python integration/run_case.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from integration.parity import peak_figures  # noqa: E402 - after the path fix above

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(__file__).resolve().parent / "models"
PROMPT_LEN, NUM_PROMPTS = 40, 4
CORRUPT_BLOCKS = 256
# vLLM 0.26.0's default max_num_batched_tokens for the offline LLM class on a GPU of 70 GiB or more
# (EngineArgs.get_batch_defaults); below it, vLLM uses max_num_seqs x max_model_len, which no batch of max_num_seqs
# prompts of max_model_len - 1 tokens (one token left to generate) can fill.
LLM_CLASS_BATCHED_TOKENS = 16384
THROUGHPUT_PROMPT_LEN = 32


def _env(args: argparse.Namespace) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on the lent multi-GPU machines
    # "plugin": engine core and worker in their own processes; the vllm.general_plugins entry point patches them.
    multiprocess = args.mode == "plugin"
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
                      VLLM_USE_V2_MODEL_RUNNER="1" if args.runner == "v2" else "0",
                      EXTENSIBLE_KV_CACHE="1" if multiprocess else "0",
                      VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                      HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                      VLLM_USE_FLASHINFER_SAMPLER="0",
                      VLLM_BATCH_INVARIANT="1" if args.batch_invariant else "0")


def max_num_batched_tokens(args: argparse.Namespace) -> int | None:
    """The explicit ``--max-num-batched-tokens``, else the largest a peak-shaped batch can fill: vLLM's LLM-class
    default, or ``max_num_seqs x (max_model_len - 1)`` where that is smaller. ``None``: vLLM's own default (no
    ``--max-num-seqs``)."""
    if args.max_num_batched_tokens:
        return args.max_num_batched_tokens
    if not args.max_num_seqs:
        return None
    return min(LLM_CLASS_BATCHED_TOKENS, args.max_num_seqs * (args.max_model_len - 1))


def prompt_len(args: argparse.Namespace) -> int:
    """Prompt length of the measured pass: two full KV blocks and a partial one, so the measured pass reads two cached
    blocks per prompt (40 tokens up to 16-token blocks)."""
    if args.prompt_len:
        return args.prompt_len
    return PROMPT_LEN if not args.block_size or args.block_size <= 16 else 2 * args.block_size + 8


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The ``LLM(...)`` arguments of this case (no vLLM needed)."""
    kwargs = dict(model=str(MODELS / args.model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  seed=0, max_model_len=args.max_model_len, generation_config="vllm",
                  attention_config={"backend": args.backend}, enable_prefix_caching=True, enforce_eager=False,
                  gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tp,
                  kv_cache_dtype=args.kv_cache_dtype)
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if (batched := max_num_batched_tokens(args)) is not None:
        kwargs["max_num_batched_tokens"] = batched
    if args.block_size:
        kwargs["block_size"] = args.block_size
    if args.num_gpu_blocks_override:
        kwargs["num_gpu_blocks_override"] = args.num_gpu_blocks_override
    if args.capture_sizes:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": [int(s) for s in args.capture_sizes.split(",")]}
    return kwargs


def case_of(args: argparse.Namespace) -> dict:
    return {"model": args.model, "runner": args.runner, "backend": args.backend, "mode": args.mode,
            "corrupt": args.corrupt, "gpu_memory_utilization": args.gpu_memory_utilization,
            "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs or None,
            "max_num_batched_tokens": max_num_batched_tokens(args), "capture_sizes": args.capture_sizes or None,
            "tensor_parallel_size": args.tp, "kv_cache_dtype": args.kv_cache_dtype, "block_size": args.block_size,
            "num_gpu_blocks_override": args.num_gpu_blocks_override, "batch_invariant": args.batch_invariant,
            "peak": args.peak, "sensitivity": args.sensitivity, "throughput": args.throughput,
            "prompt_len": prompt_len(args)}


def prompts(vocab: int, count: int = NUM_PROMPTS, length: int | list[int] = PROMPT_LEN, seed: int = 1234
            ) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = length if isinstance(length, list) else [length] * count
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def reinit_weights(model) -> int:
    """Seeded normal weights (std 0.05), norms at 1, written in place: tokens then depend on the KV cache, and the
    harness leaves no temporary in torch's cache (a float32 copy of a 151936 x 1024 embedding would be 594 MiB of
    reserved memory that no serving process has, counted at the measured peak)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    count = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.05, generator=gen)
            count += 1
    return count


def corrupt_kv(worker) -> int:
    """Overwrite every committed block of every attention KV tensor with large noise; return elements written."""
    import torch

    from extensible_kv.vllm.worker_kv import block_dim

    # The prompts' cached blocks come first out of the block pool: the first CORRUPT_BLOCKS cover them.
    n = min(worker.model_runner.kv_cache_config.num_blocks, CORRUPT_BLOCKS)
    gen = torch.Generator(device="cuda").manual_seed(7)
    written = 0
    for t in worker.model_runner.kv_caches:
        if not isinstance(t, torch.Tensor):
            continue  # Mamba state lists
        part = t.narrow(block_dim(t), 0, n)
        if part.element_size() == 1:  # fp8 caches (uint8 or float8 views): random bytes
            part.view(torch.uint8).random_(0, 256, generator=gen)
        else:
            part.normal_(0.0, 10.0, generator=gen)
        written += part.numel()
    torch.cuda.synchronize()
    return written


_GRAPH_MEMORY: list[int] = []
_PROFILE: list[dict] = []


def record_runner_memory() -> None:
    """Keep what each runner's capture_model returns (the memory its CUDA graphs took) and what torch allocated and
    reserved for the profiled activation peak (``patches.profile_run_reserved_peak``), for the report."""
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu import model_runner as v2_model_runner

    from extensible_kv.vllm.patches import profile_run_reserved_peak

    for cls in (gpu_model_runner.GPUModelRunner, v2_model_runner.GPUModelRunner):
        capture, profile = cls.capture_model, cls.profile_run

        def capture_model(self, *args, _original=capture, **kwargs):
            result = _original(self, *args, **kwargs)
            _GRAPH_MEMORY.append(int(result or 0))
            return result

        def profile_run(self, *args, _original=profile, **kwargs):
            run = profile_run_reserved_peak(lambda: _original(self, *args, **kwargs))
            result = run()
            _PROFILE.append(dict(run.figures))
            return result

        cls.capture_model, cls.profile_run = capture_model, profile_run


def _kv_backed(worker) -> int:
    """Bytes the extensible KV cache maps now (0 for legacy, whose KV cache is a torch allocation)."""
    state = getattr(worker, "_extensible_kv_state", None)
    return int(state.buffers.stats().backed_bytes) if state is not None and state.buffers is not None else 0


def pool_summary() -> list[dict]:
    """torch's segments on this device, summed per (pool, segment type, stream): where the reserved bytes are."""
    import torch

    device = torch.cuda.current_device()
    sums: dict[tuple, dict] = {}
    for s in torch.cuda.memory_snapshot():
        if int(s["device"]) != device:
            continue
        key = (tuple(s.get("segment_pool_id") or (0, 0)), s.get("segment_type"), int(s.get("stream") or 0))
        row = sums.setdefault(key, {"pool": list(key[0]), "segment_type": key[1], "stream": key[2], "segments": 0,
                                    "total_size": 0, "active_size": 0})
        row["segments"] += 1
        row["total_size"] += int(s["total_size"])
        row["active_size"] += int(s["active_size"])
    return sorted(sums.values(), key=lambda r: -r["total_size"])


def memory_figures(worker) -> dict:
    """vLLM's own profiling figures and a post-warmup measurement, for legacy and extensible runs alike."""
    import torch

    from extensible_kv.vllm.worker_kv import runner_kind, torch_reusable_now

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "total": int(total), "free_after_warmup": int(free),
        "init_free": int(worker.init_snapshot.free_memory), "requested": int(worker.requested_memory),
        "weights": int(worker.model_runner.model_memory_usage),
        "profiled_peak_activation": int(getattr(worker, "peak_activation_memory", 0)),
        "profiled_non_torch": int(getattr(worker, "non_torch_memory", 0)),
        "cudagraph_estimate": int(getattr(worker, "cudagraph_memory_estimate", 0)),
        "available_kv_cache_memory": int(getattr(worker, "available_kv_cache_memory_bytes", 0)),
        "torch_reserved": int(torch.cuda.memory_reserved()),
        "torch_reusable": torch_reusable_now(),
        "num_gpu_blocks": int(worker.cache_config.num_gpu_blocks),
        "cudagraph_memory": _GRAPH_MEMORY[-1] if _GRAPH_MEMORY else None,
        "runner": runner_kind(worker.model_runner),
        "kv_backed_after_warmup": _kv_backed(worker),
        "profile": _PROFILE[-1] if _PROFILE else None,
        "pools_after_warmup": pool_summary(),
    }


# -- the peak-shaped batch -----------------------------------------------------------------------------------------
def peak_batch_lengths(batched_tokens: int, num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the peak-shaped batch: ``batched_tokens`` tokens over ``num_seqs`` sequences, each at most
    ``max_model_len - 1`` (one token to generate). Fewer tokens where they do not fit (the batch records it)."""
    per, extra = divmod(batched_tokens, num_seqs)
    lengths = [per + (1 if i < extra else 0) for i in range(num_seqs)]
    return [min(n, max_model_len - 1) for n in lengths if n > 0]


def _peak_start(worker) -> dict:
    """Before the batch: count the tokens of every step and restart torch's peak statistics."""
    import torch

    seen: list[int] = []
    original = worker.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        seen.append(int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0))
        return original(scheduler_output, *args, **kwargs)

    worker.execute_model = execute_model  # run_method resolves "execute_model" on this object first
    worker._peak_step_tokens = seen
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    figures = {"free": int(free), "torch_reserved": int(torch.cuda.memory_reserved()),
               "torch_allocated": int(torch.cuda.memory_allocated()), "kv_backed": _kv_backed(worker)}
    torch.cuda.reset_peak_memory_stats()
    return figures


def _peak_end(worker) -> dict:
    import torch

    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    seen = worker._peak_step_tokens
    del worker.execute_model, worker._peak_step_tokens
    return {"free_after_batch": int(free), "torch_max_reserved": int(torch.cuda.max_memory_reserved()),
            "torch_reserved_after": int(torch.cuda.memory_reserved()),
            "torch_max_allocated": int(torch.cuda.max_memory_allocated()), "kv_backed": _kv_backed(worker),
            "step_tokens": seen, "pools": pool_summary()}


def run_peak(llm, vocab: int) -> tuple[dict, list[dict]]:
    """The peak-shaped batch after the final commit and what it took (``memory.peak``), per rank."""
    from vllm import SamplingParams

    config = llm.llm_engine.vllm_config
    batched, seqs = config.scheduler_config.max_num_batched_tokens, config.scheduler_config.max_num_seqs
    lengths = peak_batch_lengths(batched, seqs, config.model_config.max_model_len)
    batch = [{"prompt_token_ids": p} for p in prompts(vocab, length=lengths, seed=4321)]
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)
    before = llm.collective_rpc(_peak_start)
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.collective_rpc(_peak_end)
    shape = {"max_num_batched_tokens": batched, "max_num_seqs": seqs, "num_seqs": len(lengths),
             "prompt_tokens": sum(lengths), "cached_tokens": sum(getattr(o, "num_cached_tokens", 0) or 0
                                                                 for o in outputs),
             "seconds": round(seconds, 3)}
    ranks = []
    for b, a in zip(before, after):
        ranks.append({"batch": shape | {"step_tokens": a.pop("step_tokens")}, "before_batch": b, **a})
    return ranks[0], ranks


# -- steady-state decode throughput --------------------------------------------------------------------------------
def run_throughput(llm, vocab: int, num_seqs: int, warm_steps: int, steps: int, windows: int) -> dict:
    """Generated tokens per second over ``windows`` windows of ``steps`` engine steps, once all ``num_seqs``
    sequences decode (after ``warm_steps`` tokens each): decode only, no prefill in any window."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    max_tokens = warm_steps + windows * steps + 16
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for i, p in enumerate(prompts(vocab, count=num_seqs, length=THROUGHPUT_PROMPT_LEN, seed=555)):
        engine.add_request(f"throughput-{i}", {"prompt_token_ids": p}, params)
    produced: dict[str, int] = {}
    warm_start = time.perf_counter()
    while len(produced) < num_seqs or min(produced.values()) < warm_steps:
        for o in engine.step():
            produced[o.request_id] = produced.get(o.request_id, 0) + len(o.outputs[0].token_ids)
    warm_seconds = time.perf_counter() - warm_start
    results = []
    for _ in range(windows):
        tokens, start = 0, time.perf_counter()
        for _ in range(steps):
            tokens += sum(len(o.outputs[0].token_ids) for o in engine.step())
        results.append({"tokens": tokens, "seconds": time.perf_counter() - start})
    while engine.has_unfinished_requests():
        engine.step()
    rates = sorted(r["tokens"] / r["seconds"] for r in results)
    return {"num_seqs": num_seqs, "prompt_len": THROUGHPUT_PROMPT_LEN, "warm_steps": warm_steps,
            "steps_per_window": steps, "windows": results, "warm_seconds": round(warm_seconds, 3),
            "tokens_per_s": rates[len(rates) // 2]}


# -- the case ------------------------------------------------------------------------------------------------------
def _refusal_types() -> tuple[type, ...]:
    """What an engine raises when vLLM (or the extensible path) refuses a configuration: config and backend
    validation raise ValueError (pydantic's ValidationError is one), unimplemented paths NotImplementedError."""
    from extensible_kv.vllm import ExtensibleKVUnsupported

    return ValueError, NotImplementedError, ExtensibleKVUnsupported


def run(args: argparse.Namespace) -> dict:
    _env(args)
    sys.path.insert(0, str(ROOT / "reference"))
    from vllm import LLM, SamplingParams

    from extensible_kv.vllm import ExtensibleKVUnsupported, extensible_kv_cache

    config = json.loads((MODELS / args.model / "config.json").read_text())
    vocab = config["vocab_size"]
    kwargs = engine_kwargs(args)
    if args.tp > 1 and args.mode == "extensible":
        raise SystemExit("--tp > 1 runs every rank in its own process: use --mode plugin")
    if args.mode != "plugin" and args.tp == 1:  # in-process engines only: the worker runs in this process
        record_runner_memory()
    start = time.perf_counter()
    try:
        with extensible_kv_cache() if args.mode == "extensible" else nullcontext():
            llm = LLM(**kwargs)
    except _refusal_types() as exc:
        by = "extensible_kv" if isinstance(exc, ExtensibleKVUnsupported) else "vllm"
        return {"case": case_of(args), "refused": f"{type(exc).__name__}: {exc}", "refused_by": by,
                "engine_seconds": round(time.perf_counter() - start, 2)}
    engine_seconds = time.perf_counter() - start
    # After the block has exited: an engine keeps its RPCs (Note [An engine keeps its RPCs]).
    reports = llm.collective_rpc("extensible_kv_report") if args.mode != "legacy" else None
    extensible = reports[0] if reports else None
    ranks = reports if args.tp > 1 else None
    all_figures = llm.collective_rpc(memory_figures)
    figures = all_figures[0]
    reinit = llm.apply_model(reinit_weights)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts(vocab, length=prompt_len(args))]
    llm.generate(batch, warm, use_tqdm=False)
    corrupted = llm.collective_rpc(corrupt_kv)[0] if args.corrupt else 0
    outputs = llm.generate(batch, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    cached = [getattr(o, "num_cached_tokens", None) for o in outputs]
    result = {
        "case": case_of(args),
        "token_ids": tokens, "num_cached_tokens": cached, "corrupted_elements": corrupted,
        "reinitialised_parameters": reinit[0] if isinstance(reinit, list) else reinit,
        "engine_seconds": round(engine_seconds, 2), "memory": figures, "extensible": extensible,
        "ranks": {"memory": all_figures, "extensible": ranks},
    }
    if args.throughput:
        seqs = args.max_num_seqs or llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
        result["throughput"] = run_throughput(llm, vocab, seqs, args.throughput_warm_steps, args.throughput_steps,
                                              args.throughput_windows)
    if args.peak:
        peak, peak_ranks = run_peak(llm, vocab)
        figures["peak"] = peak_figures(figures, peak)
        result["ranks"]["peak"] = [peak_figures(f, p) for f, p in zip(all_figures, peak_ranks)]
    if args.sensitivity and not args.corrupt:
        written = llm.collective_rpc(corrupt_kv)[0]
        dirty = llm.generate(batch, params, use_tqdm=False)
        dirty_tokens = [list(o.outputs[0].token_ids) for o in dirty]
        result["sensitivity"] = {"corrupted_elements": written, "token_ids": dirty_tokens,
                                 "num_cached_tokens": [getattr(o, "num_cached_tokens", None) for o in dirty],
                                 "changed": dirty_tokens != tokens}
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m integration.run_case")
    p.add_argument("--model", default="tiny-llama", choices=sorted(d.name for d in MODELS.iterdir()))
    p.add_argument("--runner", choices=["v1", "v2"], required=True)
    p.add_argument("--backend", default="FLASH_ATTN")
    p.add_argument("--mode", choices=["legacy", "extensible", "plugin"], required=True,
                   help="legacy: vLLM as is; extensible: in-process with the context manager; plugin: "
                        "multiprocess engine switched on by EXTENSIBLE_KV_CACHE=1 through the entry point")
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype: auto (the model dtype), fp8, ...")
    p.add_argument("--block-size", type=int, default=None, help="KV block size in tokens (default: vLLM's)")
    p.add_argument("--corrupt", action="store_true", help="overwrite the committed KV blocks before the measured pass")
    p.add_argument("--peak", action=argparse.BooleanOptionalAction, default=True,
                   help="end with the peak-shaped batch and record memory.peak (default on)")
    p.add_argument("--sensitivity", action=argparse.BooleanOptionalAction, default=True,
                   help="then overwrite the committed KV blocks and run the measured pass again (default on)")
    p.add_argument("--batch-invariant", action="store_true", help="VLLM_BATCH_INVARIANT=1 (vLLM's deterministic mode)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--throughput", action="store_true", help="measure steady-state decode tokens/s")
    p.add_argument("--throughput-warm-steps", type=int, default=32)
    p.add_argument("--throughput-steps", type=int, default=100, help="engine steps per timed window")
    p.add_argument("--throughput-windows", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=None,
                   help="measured prompts' length (default 40, or 2 blocks + 8 tokens for blocks over 16 tokens)")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: min(16384, max_num_seqs x (max_model_len - 1)), so the peak batch fills it")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=8, help="0: vLLM's default")
    p.add_argument("--capture-sizes", default="1,2,4,8", help="comma-separated; empty: vLLM's default sizes")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (TP > 1 needs --mode plugin or "
                                                     "legacy: every rank is its own process)")
    p.add_argument("--dry-run", action="store_true", help="print the case and the engine arguments; run nothing")
    p.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.dry_run:
        print(json.dumps({"case": case_of(args), "engine": engine_kwargs(args)}, indent=2))
        return 0
    result = run(args)
    from extensible_kv.measurements import Environment, IntegrationCase, write  # noqa: PLC0415 (after run(): path)

    out = write(args.out, IntegrationCase.model_validate_json(json.dumps(result)))
    write(out.parent / "environment.json", Environment.collect())
    brief = {"case": result["case"], "engine_seconds": result["engine_seconds"]}
    if result.get("refused"):
        brief["refused"] = result["refused"]
    else:
        brief["blocks"] = result["memory"]["num_gpu_blocks"]
        if "peak" in result["memory"]:
            brief["over_budget_measured_mib"] = result["memory"]["peak"]["over_budget_measured"] / 2**20
    print(json.dumps(brief))
    return 0


if __name__ == "__main__":
    sys.exit(main())
