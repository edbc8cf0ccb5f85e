"""One vLLM 0.26.0 case in this process: build an engine (legacy or extensible KV cache), generate greedily, and
write token ids and memory figures as JSON.

    python -m integration.run_case --model tiny-llama --runner v2 --backend FLASH_ATTN --mode extensible \
        --out reports/out/integration/case.json [--corrupt]

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the extensible patches and the KV checks apply
to the worker directly. Weights come from the dummy loader and are then re-initialised from a seeded normal (the
dummy loader's +-1e-3 weights make tokens insensitive to the KV cache). Prompts are token ids.

The generation runs twice over the same prompts: a one-token pass fills the prefix cache, then the measured pass
reads those cached KV blocks. ``--corrupt`` overwrites every committed KV block between the two passes, which must
change the tokens (the sensitivity check).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

MODELS = Path(__file__).resolve().parent / "models"
PROMPT_LEN, NUM_PROMPTS = 40, 4
CORRUPT_BLOCKS = 256


def _env(runner: str, mode: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on the lent multi-GPU machines
    # "plugin": engine core and worker in their own processes; the vllm.general_plugins entry point patches them.
    multiprocess = mode == "plugin"
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
                      VLLM_USE_V2_MODEL_RUNNER="1" if runner == "v2" else "0",
                      EXTENSIBLE_KV_CACHE="1" if multiprocess else "0",
                      VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                      HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                      VLLM_USE_FLASHINFER_SAMPLER="0")


def prompts(vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(NUM_PROMPTS)]


def reinit_weights(model) -> int:
    """Seeded normal weights (std 0.05), norms at 1: tokens then depend on the KV cache."""
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
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(0.05))
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
        part.normal_(0.0, 10.0, generator=gen)
        written += part.numel()
    torch.cuda.synchronize()
    return written


_GRAPH_MEMORY: list[int] = []


def record_graph_memory() -> None:
    """Keep what each runner's capture_model returns (the memory its CUDA graphs took), for the report."""
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu import model_runner as v2_model_runner

    for cls in (gpu_model_runner.GPUModelRunner, v2_model_runner.GPUModelRunner):
        original = cls.capture_model

        def capture_model(self, *args, _original=original, **kwargs):
            result = _original(self, *args, **kwargs)
            _GRAPH_MEMORY.append(int(result or 0))
            return result

        cls.capture_model = capture_model


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
    }


def run(args: argparse.Namespace) -> dict:
    _env(args.runner, args.mode)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
    from contextlib import nullcontext

    from vllm import LLM, SamplingParams

    from extensible_kv.vllm import extensible_kv_cache

    model_dir = MODELS / args.model
    config = json.loads((model_dir / "config.json").read_text())
    kwargs = dict(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                  max_model_len=args.max_model_len, generation_config="vllm",
                  attention_config={"backend": args.backend}, enable_prefix_caching=True, enforce_eager=False,
                  gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tp)
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.capture_sizes:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": [int(s) for s in args.capture_sizes.split(",")]}
    if args.tp > 1 and args.mode == "extensible":
        raise SystemExit("--tp > 1 runs every rank in its own process: use --mode plugin")
    if args.mode != "plugin" and args.tp == 1:  # in-process engines only: the worker runs in this process
        record_graph_memory()
    start = time.perf_counter()
    with extensible_kv_cache() if args.mode == "extensible" else nullcontext():
        llm = LLM(**kwargs)
        engine_seconds = time.perf_counter() - start
        reports = llm.collective_rpc("extensible_kv_report") if args.mode != "legacy" else None
    extensible = reports[0] if reports else None
    ranks = reports if args.tp > 1 else None
    all_figures = llm.collective_rpc(memory_figures)
    figures = all_figures[0]
    reinit = llm.apply_model(reinit_weights)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts(config["vocab_size"])]
    llm.generate(batch, warm, use_tqdm=False)
    corrupted = llm.collective_rpc(corrupt_kv)[0] if args.corrupt else 0
    outputs = llm.generate(batch, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    cached = [getattr(o, "num_cached_tokens", None) for o in outputs]
    return {
        "case": {"model": args.model, "runner": args.runner, "backend": args.backend, "mode": args.mode,
                 "corrupt": args.corrupt, "gpu_memory_utilization": args.gpu_memory_utilization,
                 "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs or None,
                 "capture_sizes": args.capture_sizes or None, "tensor_parallel_size": args.tp},
        "token_ids": tokens, "num_cached_tokens": cached, "corrupted_elements": corrupted,
        "reinitialised_parameters": reinit[0] if isinstance(reinit, list) else reinit,
        "engine_seconds": round(engine_seconds, 2), "memory": figures, "extensible": extensible,
        "ranks": {"memory": all_figures, "extensible": ranks},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integration.run_case")
    parser.add_argument("--model", default="tiny-llama", choices=sorted(p.name for p in MODELS.iterdir()))
    parser.add_argument("--runner", choices=["v1", "v2"], required=True)
    parser.add_argument("--backend", default="FLASH_ATTN")
    parser.add_argument("--mode", choices=["legacy", "extensible", "plugin"], required=True,
                        help="legacy: vLLM as is; extensible: in-process with the context manager; plugin: "
                             "multiprocess engine switched on by EXTENSIBLE_KV_CACHE=1 through the entry point")
    parser.add_argument("--corrupt", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="0: vLLM's default")
    parser.add_argument("--capture-sizes", default="1,2,4,8", help="comma-separated; empty: vLLM's default sizes")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (TP > 1 needs --mode plugin or "
                                                           "legacy: every rank is its own process)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = run(args)
    from extensible_kv.measurements import Environment, IntegrationCase, write  # noqa: PLC0415 (after run(): path)

    out = write(args.out, IntegrationCase.model_validate_json(json.dumps(result)))
    write(out.parent / "environment.json", Environment.collect())
    print(json.dumps({k: result[k] for k in ("case", "engine_seconds")} | {"blocks": result["memory"]["num_gpu_blocks"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
