"""One vLLM 0.26.0 case in this process: build an engine (legacy or extensible KV cache), generate greedily, and
write token ids and memory figures as JSON.

    python -m integration.run_case --model tiny-llama --runner v2 --backend FLASH_ATTN --mode extensible \
        --out reports/out/integration/case.json [--kv-cache-dtype fp8] [--block-size 32] [--corrupt] \
        [--no-peak] [--throughput --num-gpu-blocks-override 16384] [--batch-invariant] [--speculative ngram:4] \
        [--dry-run]

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the extensible patches and the KV checks apply
to the worker directly. Weights come from the dummy loader and are then re-initialised in place from a seeded normal
(the dummy loader's +-1e-3 weights make tokens insensitive to the KV cache). Prompts are token ids.

Run it as a module from the repository root (it imports ``integration.parity`` and the installed ``extensible_kv``).
``run()`` is the phases below in order, each its own function returning its figures (a model of
``extensible_kv_lab.measurements`` where the case file has one, else a dict); ``case_file`` assembles them. What the
model runners record (CUDA graph memory, vLLM's profiles, the encoder cache) goes into one ``RunnerRecord`` per
case, made by ``run()``. After the engine is built (``built_engine``):

1. ``extensible_kv_report`` (after the ``extensible_kv_cache()`` block has exited: Note [An engine keeps its RPCs])
   and the memory figures after warmup and the final commit (``memory``; ``warmup_figures``).
2. The generation runs twice over the same prompts: a one-token pass fills the prefix cache, then the measured pass
   reads those cached KV blocks (``token_ids``; ``measured_passes``). ``--corrupt`` overwrites every committed KV
   block between the two passes, which must change the tokens.
3. ``--throughput``: steady-state decode tokens/s (``throughput``; ``throughput_phase``; ``integration.parity`` turns
   a legacy and an extensible run into pytest-benchmark JSON).
4. ``--peak`` (default): the peak-shaped batch, ``max_num_batched_tokens`` prompt tokens over ``max_num_seqs``
   sequences with ``max_tokens=1``, then device memory used since the worker started against the budget
   (``memory.peak``; ``peak_phase``; the definition is Note [Over budget at the measured peak] in
   ``integration/parity.py``). Before it, with ``--speculative``, the widest speculative step
   (``speculative_phase``) and, for a multimodal model, the encoder cache filled (``encoder_fill_phase``; below);
   after it, the encoder cache read (``encoder_cache_phase``; without ``--peak`` too where the worker runs here).
5. ``--sensitivity`` (default, not with ``--corrupt``): every committed KV block is overwritten and the measured pass
   runs again; its tokens must differ from step 2's (``sensitivity``; ``sensitivity_phase``): the parity comparison
   can fail.

An engine that vLLM (or the extensible path) refuses to build for this combination writes ``refused`` (the
exception's text) instead and exits 0, so a matrix goes on. vLLM 0.26.0 refuses ngram speculative decoding on the
V2 runner while it builds its config: ``ValidationError: 1 validation error for VllmConfig / Value error, Model
Runner V2 does not yet support: ngram/ngram_gpu speculative decoding`` (pydantic's ValidationError is a ValueError).

Multimodal cases (a model whose ``config.json`` has a ``vision_config``: ``tiny-mm``, a Qwen2-VL shape)
    The engine gets the tokenizer (``skip_tokenizer_init=False``; the processor needs it) and
    ``limit_mm_per_prompt={"image": 1, "video": 0}``. Every prompt carries one image: text ids from ``[3, 1020)``
    (below every marker id), then vision_start (1020), ONE image_pad (1022; vLLM expands it to the image's 576
    tokens: the processor resizes every image to 672 x 672, 48 x 48 patches merged 2 x 2) and vision_end (1021)
    after the first ``IMAGE_TEXT_BEFORE`` text tokens. Images are 224 x 224 RGB noise from
    ``numpy.random.default_rng(seed)``, each prompt its own seed (identical images share one encoder cache entry).
    The case needs ``torchvision`` (vLLM's Qwen2-VL image processor imports it), ``PIL`` and ``numpy``: missing,
    the run fails before building an engine, ``refused: tiny-mm needs torchvision (...)`` naming the import.

    The encoder cache. vLLM's scheduler gives it ``encoder_cache_size`` tokens (``max_num_batched_tokens`` by
    default, ``MultiModalBudget``), so it holds ``16,384 // 576 = 28`` images at 16,384 batched tokens. An entry is
    not freed when its request finishes: ``EncoderCacheManager.free`` only marks it freeable, and ``can_allocate``
    evicts freeable entries, oldest first, only when a new item needs the room; the runner drops an entry when the
    scheduler's ``free_encoder_mm_hashes`` names it. So finished requests' outputs stay on the GPU until the cache
    is full. vLLM's V1 profile holds one profiled batch of items (``min(28, max_num_seqs x 1) = 8``) in the cache
    during its dummy forward; V2's profile runs no encoder (0). Before the peak batch the case therefore runs
    ``fill_rounds`` rounds of ``max_num_seqs`` requests of ``FILL_TEXT_LEN`` text tokens and one image each
    (``max_tokens=1``): enough that the measured pass's 4 images, the rounds' and the peak batch's 8 bring the cache
    to its 28 (two rounds at ``max_num_seqs=8``), and the peak batch (``max_num_seqs`` prompts of one image each,
    ``max_num_batched_tokens`` tokens with the images expanded) runs with the cache full. ``memory.encoder_cache``:
    ``profiled_bytes`` (the most the runner's cache held during vLLM's profile_run: V1 ``encoder_cache``, a dict of
    GPU tensors; V2 ``encoder_cache.encoder_outputs``), ``held_bytes`` (the most it held after any
    ``execute_model`` of the case's generation, fill and peak batch; ``items_held`` then), ``bytes_per_item``, and
    ``capacity_items`` / ``items_at_peak``. Bytes are the distinct storages under the cached tensors (one batch's
    outputs are views of one tensor). In-process runs only (``record_runner_memory``).

Speculative decoding (``--speculative ngram:K``)
    The engine gets ``speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
    "prompt_lookup_min": 2}``, legacy and extensible alike; tokens are compared with legacy's with the same
    speculation. With ``--peak``, after the generation and before the peak batch, ``max_num_seqs`` sequences decode
    ``SPECULATIVE_MAX_TOKENS`` tokens with the worker's ``model_runner.drafter.propose`` replaced so every request
    proposes exactly K drafts each step (its last token repeated): ``S x (1 + K)`` logits rows through the LM head
    and the rejection sampler, which accepts only the target's greedy tokens (this phase's tokens are not compared).
    ``memory.speculative``: ``k``, ``method``, ``requests`` (S), ``rows``, ``vocab``, ``step_peak_allocated`` (torch's
    max allocated during the phase less allocated before it), ``step_reserved_growth``, ``over_budget_measured`` at
    the phase's end (read as the peak is), ``widest_steps`` (steps that had all S requests with K drafts each) and
    every step's [scheduled tokens, requests with drafts, draft tokens]. ``memory.peak.over_budget_measured`` is the
    larger of the two phases' (``integration.parity.peak_figures``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from extensible_kv_lab.measurements import (
    CaseMemory,
    EncoderCacheFigures,
    Environment,
    ExtensibleFigures,
    IntegrationCase,
    MeasuredPeak,
    Record,
    SpeculativeFigures,
    write,
)

# integration.parity first: on a checkout without the packages installed it puts reference/ and lab/ on the path
from integration.parity import peak_figures, speculative_figures, tokens_per_s

MODELS = Path(__file__).resolve().parent / "models"
PROMPT_LEN, NUM_PROMPTS = 40, 4
CORRUPT_BLOCKS = 256
# vLLM 0.26.0's default max_num_batched_tokens for the offline LLM class on a GPU of 70 GiB or more
# (EngineArgs.get_batch_defaults); below it, vLLM uses max_num_seqs x max_model_len, which no batch of max_num_seqs
# prompts of max_model_len - 1 tokens (one token left to generate) can fill.
LLM_CLASS_BATCHED_TOKENS = 16384
THROUGHPUT_PROMPT_LEN = 32
# Multimodal cases (a model whose config has a vision_config): token ids of the image markers, never drawn as text.
MM_TOKEN_KEYS = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
IMAGE_SIDE = 224  # square RGB noise; the tiny-mm processor resizes every image to 672 x 672 (576 tokens)
IMAGE_TEXT_BEFORE = 8  # text tokens before a prompt's image, the rest after it
FILL_TEXT_LEN = 8  # text tokens of an encoder-cache fill request (plus its image)
# The first image seed of each phase: every image of a case is distinct (identical images share one cache entry).
IMAGE_SEEDS = {"measured": 10_000, "fill": 20_000, "peak": 30_000}
# What a multimodal case imports beyond vLLM; missing, the case fails naming it (refused_import).
MM_IMPORTS = (
    ("torchvision", "vLLM's Qwen2-VL image processor imports it"),
    ("PIL", "the case's images are PIL images"),
    ("numpy", "the case's images are drawn with numpy"),
)
# Speculative decoding: ngram only (draft-model-free, so the tiny configs need no second model).
SPECULATIVE_LOOKUP = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
SPECULATIVE_MAX_TOKENS = 16  # decode steps of the widest-step phase (about one per token: drafts mostly rejected)


def _env(args: argparse.Namespace) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on the lent multi-GPU machines
    # "plugin": engine core and worker in their own processes; the vllm.general_plugins entry point patches them.
    multiprocess = args.mode == "plugin"
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
        VLLM_USE_V2_MODEL_RUNNER="1" if args.runner == "v2" else "0",
        EXTENSIBLE_KV_CACHE="1" if multiprocess else "0",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_USE_FLASHINFER_SAMPLER="0",
        VLLM_BATCH_INVARIANT="1" if args.batch_invariant else "0",
    )


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


def model_config(model: str) -> dict:
    """The model's local ``config.json``."""
    return json.loads((MODELS / model / "config.json").read_text())


def is_multimodal(config: dict) -> bool:
    """A model with a vision tower (``vision_config``): its prompts carry images."""
    return "vision_config" in config


def text_token_limit(config: dict) -> int:
    """Text token ids come from ``[3, limit)``: inside the vocabulary and below every image marker id (1020 for
    ``tiny-mm``; ``vocab_size`` for a text model)."""
    return min([config["vocab_size"]] + [config[k] for k in MM_TOKEN_KEYS if k in config])


def speculative_arg(text: str) -> str:
    """``--speculative``: ``ngram:K`` with ``K >= 1``."""
    method, sep, k = text.partition(":")
    if method != "ngram" or not sep or not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(f"expected ngram:K with K >= 1 drafts per step (e.g. ngram:4), got {text!r}")
    return f"{method}:{int(k)}"


def speculative_config(spec: str | None) -> dict | None:
    """vLLM's ``speculative_config`` for ``--speculative METHOD:K`` (``None``: no speculative decoding)."""
    if not spec:
        return None
    method, _, k = spec.partition(":")
    return {"method": method, "num_speculative_tokens": int(k), **SPECULATIVE_LOOKUP}


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The ``LLM(...)`` arguments of this case (no vLLM needed)."""
    kwargs = dict(
        model=str(MODELS / args.model),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=args.max_model_len,
        generation_config="vllm",
        attention_config={"backend": args.backend},
        enable_prefix_caching=True,
        enforce_eager=False,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tp,
        kv_cache_dtype=args.kv_cache_dtype,
    )
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
    if is_multimodal(model_config(args.model)):
        # The processor needs the tokenizer; one image per prompt, no video (the profile then sizes for images).
        kwargs.update(skip_tokenizer_init=False, limit_mm_per_prompt={"image": 1, "video": 0})
    if args.speculative:
        kwargs["speculative_config"] = speculative_config(args.speculative)
    return kwargs


def case_of(args: argparse.Namespace) -> dict:
    return {
        "model": args.model,
        "runner": args.runner,
        "backend": args.backend,
        "mode": args.mode,
        "corrupt": args.corrupt,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs or None,
        "max_num_batched_tokens": max_num_batched_tokens(args),
        "capture_sizes": args.capture_sizes or None,
        "tensor_parallel_size": args.tp,
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "batch_invariant": args.batch_invariant,
        "peak": args.peak,
        "sensitivity": args.sensitivity,
        "throughput": args.throughput,
        "prompt_len": prompt_len(args),
        "speculative": args.speculative,
        "multimodal": is_multimodal(model_config(args.model)),
    }


def prompts(
    vocab: int, count: int = NUM_PROMPTS, length: int | list[int] = PROMPT_LEN, seed: int = 1234
) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = length if isinstance(length, list) else [length] * count
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


# -- prompts with images ------------------------------------------------------------------------------------------
def image_prompts(config: dict, text_lengths: list[int], seed: int, image_seed: int) -> list[dict]:
    """One prompt per entry of ``text_lengths``: that many text ids from ``[3, text_token_limit)``, with one image
    after the first ``IMAGE_TEXT_BEFORE`` of them as vision_start, ONE image_pad (vLLM's processor expands it to
    the image's tokens) and vision_end. Each prompt's image is its own: ``image_seed`` is ``image_seed + i``.
    Returns ``{"prompt_token_ids", "image_seed"}`` (``vllm_prompts`` draws the images)."""
    if min(text_lengths, default=0) < 0:
        raise ValueError(
            f"image prompts: text lengths must be >= 0, got {min(text_lengths)} (a prompt shorter than its image)"
        )
    marker = [config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]]
    texts = prompts(text_token_limit(config), length=list(text_lengths), seed=seed) if text_lengths else []
    return [
        {"prompt_token_ids": t[:IMAGE_TEXT_BEFORE] + marker + t[IMAGE_TEXT_BEFORE:], "image_seed": image_seed + i}
        for i, t in enumerate(texts)
    ]


def image_text_lengths(lengths: list[int], image_tokens: int) -> list[int]:
    """Text lengths of image prompts that are ``lengths`` tokens long once each image is ``image_tokens`` tokens
    (plus its start and end markers)."""
    return [n - image_tokens - 2 for n in lengths]


def image(seed: int):
    """A square RGB noise image of ``IMAGE_SIDE`` pixels, the same for the same seed."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def vllm_prompts(specs: list[dict]) -> list[dict]:
    """vLLM prompts of ``image_prompts`` specs (``multi_modal_data`` with the image of each ``image_seed``) or of
    plain ``{"prompt_token_ids"}`` ones."""
    return [
        {"prompt_token_ids": s["prompt_token_ids"]}
        | ({"multi_modal_data": {"image": image(s["image_seed"])}} if "image_seed" in s else {})
        for s in specs
    ]


def fill_rounds(capacity_items: int, held_items: int, peak_items: int, per_round: int) -> int:
    """Rounds of ``per_round`` one-image requests that, with the ``held_items`` the encoder cache already holds and
    the peak batch's ``peak_items``, bring it to its ``capacity_items`` (``encoder_cache_size // tokens per
    item``): vLLM frees a finished request's entry lazily, only when a new item needs the room."""
    missing = capacity_items - held_items - peak_items
    return max(0, -(-missing // per_round)) if per_round > 0 else 0


def refused_import(config: dict, model: str) -> str | None:
    """Why this machine cannot run the model's case (a multimodal model's imports), or ``None``."""
    if not is_multimodal(config):
        return None
    import importlib

    for name, why in MM_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an ImportError or a broken build (e.g. torchvision's operators)
            return f"refused: {model} needs {name} ({why}): {type(exc).__name__}: {exc}"
    return None


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

    from extensible_kv.layout import block_dim

    # The prompts' cached blocks come first out of the block pool: the first CORRUPT_BLOCKS cover them.
    n = min(worker.model_runner.kv_cache_config.num_blocks, CORRUPT_BLOCKS)
    gen = torch.Generator(device="cuda").manual_seed(7)
    written = 0
    for t in worker.model_runner.kv_caches:
        if not isinstance(t, torch.Tensor):
            continue  # Mamba state lists
        part = t.narrow(block_dim(t.shape, "KV cache tensor", num_blocks=max(t.shape)), 0, n)  # the most blocks
        if part.element_size() == 1:  # fp8 caches (uint8 or float8 views): random bytes
            part.view(torch.uint8).random_(0, 256, generator=gen)
        else:
            part.normal_(0.0, 10.0, generator=gen)
        written += part.numel()
    torch.cuda.synchronize()
    return written


_MISSING = object()


def encoder_cache_entries(runner) -> dict | None:
    """The runner's encoder cache, ``mm_hash -> encoder output``: V1 keeps the dict as ``encoder_cache``, V2 in its
    ``EncoderCache``'s ``encoder_outputs``; ``None`` where the runner has none (V2 without multimodal inputs)."""
    cache = getattr(runner, "encoder_cache", None)
    if cache is None or isinstance(cache, dict):
        return cache
    return getattr(cache, "encoder_outputs", None)


def encoder_cache_reading(entries: dict | None) -> dict:
    """What the encoder cache holds: bytes of the distinct storages under its tensors (a batch's outputs are views
    of one tensor, which stays whole while any of them is cached), item count, one item's own bytes."""
    import torch

    storages: dict[tuple, int] = {}
    per_item = 0
    for t in (entries or {}).values():
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
        per_item = per_item or t.numel() * t.element_size()
    return {"bytes": sum(storages.values()), "items": len(entries or {}), "bytes_per_item": per_item}


@dataclass
class RunnerRecord:
    """What this process's model runners recorded for the report (``record_runner_memory``): the memory each
    capture_model's CUDA graphs took (``graph_memory``), each profile_run's activation figures (``profiles``) and
    the most its encoder cache held (``encoder_profiles``), and the most the encoder cache held after any
    execute_model while ``sampling`` (``encoder_held``). One per case, made by ``run()`` and handed to whatever
    reads or switches it: the engine's own start steps must not count, only the case's phases, and a module-level
    switch would leak from one case (or test) into the next."""

    graph_memory: list[int] = field(default_factory=list)
    profiles: list[dict] = field(default_factory=list)
    encoder_profiles: list[dict] = field(default_factory=list)
    encoder_held: dict | None = None
    sampling: bool = False

    def sample(self, runner) -> None:
        """Keep the runner's encoder cache reading if it holds more bytes than any before."""
        entries = encoder_cache_entries(runner)
        if entries is None:
            return
        reading = encoder_cache_reading(entries)
        if self.encoder_held is None or reading["bytes"] > self.encoder_held["bytes"]:
            self.encoder_held = reading

    @contextmanager
    def encoder_sampling(self) -> Iterator[None]:
        """The encoder cache sampled after every execute_model inside the block (the case's own phases)."""
        self.sampling = True
        try:
            yield
        finally:
            self.sampling = False


def record_runner_memory(record: RunnerRecord) -> None:
    """Keep in ``record`` what each runner's capture_model returns (the memory its CUDA graphs took), what torch
    allocated and reserved for the profiled activation peak (``probes.profile_run_reserved_peak``), and what the
    encoder cache held during each profile_run (read when the profile's dummy forward starts, after its encoder
    outputs are cached, and after it: V1 clears them at its end) and after every execute_model while
    ``record.sampling``, for the report. Legacy runs have no extensible patches: this is their only record."""
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu import model_runner as v2_model_runner

    from extensible_kv.vllm.probes import profile_run_reserved_peak

    for cls in (gpu_model_runner.GPUModelRunner, v2_model_runner.GPUModelRunner):
        capture, profile, execute = cls.capture_model, cls.profile_run, cls.execute_model

        def capture_model(self, *args, _original=capture, **kwargs):
            result = _original(self, *args, **kwargs)
            record.graph_memory.append(int(result or 0))
            return result

        def profile_run(self, *args, _original=profile, **kwargs):
            seen = [encoder_cache_reading(encoder_cache_entries(self))]
            own = vars(self).get("_dummy_run", _MISSING)
            dummy_run = self._dummy_run

            def _dummy_run(*a, **k):
                seen.append(encoder_cache_reading(encoder_cache_entries(self)))
                return dummy_run(*a, **k)

            self._dummy_run = _dummy_run  # this instance, this call: profile_run calls self._dummy_run
            try:
                run = profile_run_reserved_peak(lambda: _original(self, *args, **kwargs))
                result = run()
            finally:
                if own is _MISSING:
                    del self._dummy_run
                else:
                    self._dummy_run = own
            seen.append(encoder_cache_reading(encoder_cache_entries(self)))
            record.profiles.append(dict(run.figures))
            record.encoder_profiles.append(max(seen, key=lambda r: r["bytes"]))
            return result

        def execute_model(self, *args, _original=execute, **kwargs):
            result = _original(self, *args, **kwargs)
            if record.sampling:
                record.sample(self)
            return result

        cls.capture_model, cls.profile_run, cls.execute_model = capture_model, profile_run, execute_model


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
        row = sums.setdefault(
            key,
            {
                "pool": list(key[0]),
                "segment_type": key[1],
                "stream": key[2],
                "segments": 0,
                "total_size": 0,
                "active_size": 0,
            },
        )
        row["segments"] += 1
        row["total_size"] += int(s["total_size"])
        row["active_size"] += int(s["active_size"])
    return sorted(sums.values(), key=lambda r: -r["total_size"])


def memory_figures(worker, record: RunnerRecord | None = None) -> dict:
    """vLLM's own profiling figures and a post-warmup measurement, for legacy and extensible runs alike; the CUDA
    graphs' memory and the profiles come from ``record`` (``None`` where the worker is in another process, whose
    runners nobody recorded: they are then ``None``)."""
    import torch

    from extensible_kv.vllm.worker_kv import runner_kind, torch_reusable_now

    graphs, profiles = (record.graph_memory, record.profiles) if record is not None else ([], [])
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "total": int(total),
        "free_after_warmup": int(free),
        "init_free": int(worker.init_snapshot.free_memory),
        "requested": int(worker.requested_memory),
        "weights": int(worker.model_runner.model_memory_usage),
        "profiled_peak_activation": int(getattr(worker, "peak_activation_memory", 0)),
        "profiled_non_torch": int(getattr(worker, "non_torch_memory", 0)),
        "cudagraph_estimate": int(getattr(worker, "cudagraph_memory_estimate", 0)),
        "available_kv_cache_memory": int(getattr(worker, "available_kv_cache_memory_bytes", 0)),
        "torch_reserved": int(torch.cuda.memory_reserved()),
        "torch_reusable": torch_reusable_now(),
        "num_gpu_blocks": int(worker.cache_config.num_gpu_blocks),
        "cudagraph_memory": graphs[-1] if graphs else None,
        "runner": runner_kind(worker.model_runner),
        "kv_backed_after_warmup": _kv_backed(worker),
        # vLLM's own profile; an extensible run then runs it again after warmup (Note [The peak, brought back and
        # measured]): "profile_again"
        "profile": profiles[0] if profiles else None,
        "profile_again": profiles[1] if len(profiles) > 1 else None,
        "pools_after_warmup": pool_summary(),
    }


# -- the peak-shaped batch -----------------------------------------------------------------------------------------
def peak_batch_lengths(batched_tokens: int, num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the peak-shaped batch: ``batched_tokens`` tokens over ``num_seqs`` sequences, each at most
    ``max_model_len - 1`` (one token to generate). Fewer tokens where they do not fit (the batch records it)."""
    per, extra = divmod(batched_tokens, num_seqs)
    lengths = [per + (1 if i < extra else 0) for i in range(num_seqs)]
    return [min(n, max_model_len - 1) for n in lengths if n > 0]


def _scheduled_tokens(scheduler_output) -> int:
    return int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)


def _phase_start(worker, step: Callable[[object], object]) -> dict:
    """Before a measured phase (the peak batch, the widest speculative step): ``step(scheduler_output)`` of every
    step is kept until ``_phase_end``, torch's peak statistics restart; returns the readings now."""
    import torch

    from extensible_kv.vllm.worker_kv import torch_reusable_now

    steps: list = []
    original = worker.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        steps.append(step(scheduler_output))
        return original(scheduler_output, *args, **kwargs)

    worker.execute_model = execute_model  # run_method resolves "execute_model" on this object first
    worker._phase_steps = steps
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    # torch's unused cache as the phase finds it (Note [A served batch's query length] in extensible_kv.vllm.sizing)
    figures = {
        "free": int(free),
        "torch_reserved": int(torch.cuda.memory_reserved()),
        "torch_allocated": int(torch.cuda.memory_allocated()),
        "torch_reusable": torch_reusable_now(),
    }
    torch.cuda.reset_peak_memory_stats()
    return figures


def _phase_end(worker) -> tuple[int, dict, list]:
    """After a measured phase: (free device memory now, torch's readings since ``_phase_start``, every step's
    record); the step recorder is removed."""
    import torch

    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    steps = worker._phase_steps
    del worker.execute_model, worker._phase_steps
    return (
        int(free),
        {
            "torch_max_reserved": int(torch.cuda.max_memory_reserved()),
            "torch_reserved_after": int(torch.cuda.memory_reserved()),
            "torch_max_allocated": int(torch.cuda.max_memory_allocated()),
        },
        steps,
    )


def _peak_start(worker) -> dict:
    """Before the batch: count the tokens of every step and restart torch's peak statistics."""
    return {**_phase_start(worker, _scheduled_tokens), "kv_backed": _kv_backed(worker)}


def _peak_end(worker) -> dict:
    free, readings, steps = _phase_end(worker)
    return {
        "free_after_batch": free,
        **readings,
        "kv_backed": _kv_backed(worker),
        "step_tokens": steps,
        "pools": pool_summary(),
    }


def run_peak(llm, vocab: int, make_batch: Callable[[list[int]], list[dict]] | None = None) -> tuple[dict, list[dict]]:
    """The peak-shaped batch after the final commit and what it took (``memory.peak``), per rank. ``make_batch``
    turns the batch's prompt lengths (as vLLM counts them) into vLLM prompts (default: text of ``[3, vocab)``);
    the batch's ``prompt_tokens`` are the lengths vLLM reports back."""
    from vllm import SamplingParams

    config = llm.llm_engine.vllm_config
    batched, seqs = config.scheduler_config.max_num_batched_tokens, config.scheduler_config.max_num_seqs
    lengths = peak_batch_lengths(batched, seqs, config.model_config.max_model_len)
    batch = (
        make_batch(lengths)
        if make_batch is not None
        else [{"prompt_token_ids": p} for p in prompts(vocab, length=lengths, seed=4321)]
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)
    before = llm.collective_rpc(_peak_start)
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.collective_rpc(_peak_end)
    reported = [
        len(ids) if (ids := getattr(o, "prompt_token_ids", None)) is not None else n for o, n in zip(outputs, lengths)
    ]
    shape = {
        "max_num_batched_tokens": batched,
        "max_num_seqs": seqs,
        "num_seqs": len(lengths),
        "prompt_tokens": sum(reported),
        "cached_tokens": sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outputs),
        "seconds": round(seconds, 3),
    }
    ranks = []
    for b, a in zip(before, after):
        ranks.append({"batch": shape | {"step_tokens": a.pop("step_tokens")}, "before_batch": b, **a})
    return ranks[0], ranks


# -- the encoder cache, filled -------------------------------------------------------------------------------------
def encoder_budget(worker) -> dict | None:
    """The worker's encoder cache as vLLM's scheduler sizes it (``probes.encoder_cache_budget``); ``None`` for a
    model without multimodal inputs."""
    from extensible_kv.vllm.probes import encoder_cache_budget

    return encoder_cache_budget(worker.model_runner)


def encoder_cache_now(worker) -> dict | None:
    """What the worker's encoder cache holds now (``encoder_cache_reading``); ``None`` where it has none."""
    entries = encoder_cache_entries(worker.model_runner)
    return None if entries is None else encoder_cache_reading(entries)


def run_encoder_fill(llm, config: dict, rounds: int, per_round: int) -> int:
    """``rounds`` rounds of ``per_round`` requests of ``FILL_TEXT_LEN`` text tokens and one image each (every image
    distinct), one token each: their encoder outputs stay in the cache after they finish (vLLM frees an entry only
    when a new item needs the room). Returns the requests run."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)
    for r in range(rounds):
        specs = image_prompts(
            config, [FILL_TEXT_LEN] * per_round, seed=6000 + r, image_seed=IMAGE_SEEDS["fill"] + r * per_round
        )
        llm.generate(vllm_prompts(specs), params, use_tqdm=False)
    return rounds * per_round


def image_batch(config: dict, tokens_per_image: int) -> Callable[[list[int]], list[dict]]:
    """The peak batch's prompts for ``run_peak``: one image each (``IMAGE_SEEDS["peak"]`` on), text filling each
    prompt to its length once vLLM expands the image to ``tokens_per_image`` tokens."""

    def make_batch(lengths: list[int]) -> list[dict]:
        return vllm_prompts(
            image_prompts(
                config, image_text_lengths(lengths, tokens_per_image), seed=4321, image_seed=IMAGE_SEEDS["peak"]
            )
        )

    return make_batch


def encoder_cache_figures(
    record: RunnerRecord, budget: dict, at_peak: dict | None, fill_requests: int
) -> EncoderCacheFigures:
    """``memory.encoder_cache``: what the cache held during vLLM's profile (its first profile_run; the extensible
    sizing runs it again after warmup: ``profile_runs``), the most it held during the case (``held_bytes``, with
    ``items_held`` at that moment), and at the measured peak's reading."""
    profiles = record.encoder_profiles
    held = record.encoder_held or {"bytes": 0, "items": 0, "bytes_per_item": 0}
    per_item = held["bytes_per_item"] or (at_peak or {}).get("bytes_per_item") or 0
    figures = {
        "profiled_bytes": profiles[0]["bytes"] if profiles else None,
        "profiled_items": profiles[0]["items"] if profiles else None,
        "profile_runs": [p["bytes"] for p in profiles],
        "held_bytes": held["bytes"],
        "items_held": held["items"],
        "bytes_per_item": per_item,
        "at_peak_bytes": (at_peak or {}).get("bytes"),
        "items_at_peak": (at_peak or {}).get("items"),
        "fill_requests": fill_requests,
        **budget,
    }
    return EncoderCacheFigures.model_validate(figures)


# -- speculative decoding at its widest step -----------------------------------------------------------------------
def _draft_counts(scheduler_output) -> list[int]:
    """A step's [scheduled tokens, requests with drafts, draft tokens]."""
    drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    return [
        _scheduled_tokens(scheduler_output),
        sum(1 for d in drafts.values() if d),
        sum(len(d) for d in drafts.values()),
    ]


def _spec_start(worker, k: int) -> dict:
    """Before the phase: every request proposes exactly ``k`` drafts (its last token repeated) in place of the
    drafter's own, every step's [scheduled tokens, requests with drafts, draft tokens] is counted, torch's peak
    statistics restart."""
    drafter = getattr(worker.model_runner, "drafter", None)
    if drafter is None:
        raise RuntimeError(
            f"speculative phase: the model runner ({type(worker.model_runner).__name__}) has no "
            f"drafter to propose {k} drafts"
        )

    def propose(num_speculative_tokens, sampled_token_ids, *args, **kwargs):
        return [[int(ids[-1])] * k if len(ids) else [] for ids in sampled_token_ids]

    worker._spec_own_propose = vars(drafter).get("propose", _MISSING)
    drafter.propose = propose
    return _phase_start(worker, _draft_counts)


def _spec_end(worker) -> dict:
    free, readings, steps = _phase_end(worker)
    drafter, own = worker.model_runner.drafter, worker._spec_own_propose
    if own is _MISSING:
        del drafter.propose
    else:
        drafter.propose = own
    del worker._spec_own_propose
    return {"free_after": free, **readings, "steps": steps}


def run_speculative(llm, vocab: int, spec: str, lm_vocab: int) -> list[dict]:
    """The widest speculative step, measured (``memory.speculative``, per rank; ``speculative_figures``):
    ``max_num_seqs`` sequences of ``THROUGHPUT_PROMPT_LEN`` tokens decode ``SPECULATIVE_MAX_TOKENS`` tokens with
    every sequence proposing exactly K drafts each step (``S x (1 + K)`` logits rows of ``lm_vocab``). The rejection
    sampler accepts only the target's greedy tokens, so parity is untouched; these tokens are not compared."""
    from vllm import SamplingParams

    k = int(spec.partition(":")[2])
    seqs = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    batch = [{"prompt_token_ids": p} for p in prompts(vocab, count=seqs, length=THROUGHPUT_PROMPT_LEN, seed=777)]
    params = SamplingParams(temperature=0.0, max_tokens=SPECULATIVE_MAX_TOKENS, detokenize=False, ignore_eos=True)
    before = llm.collective_rpc(partial(_spec_start, k=k))
    start = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.collective_rpc(_spec_end)
    return [
        {
            "k": k,
            "method": spec.partition(":")[0],
            "requests": seqs,
            "vocab": lm_vocab,
            "before": b,
            "max_tokens": SPECULATIVE_MAX_TOKENS,
            "seconds": round(seconds, 3),
            **a,
        }
        for b, a in zip(before, after)
    ]


# -- steady-state decode throughput --------------------------------------------------------------------------------
# Note [No garbage from the engine's start in a window]
# Building an engine leaves Python garbage behind, and the extensible engine's sizing (the batches run again after
# warmup) may leave more of it; a full collection of Python's garbage collector falling into a timed window would
# then be a cost of the process, not of the KV cache. On the H200 the first V1 pair's first window took 1.091 s
# extensible against 1.035 s legacy, the four after it within 2% (``reports/runs/h200-matrix-current-2026-12-03/``);
# whether a collection caused it was not recorded then (a suspect, read from the code, not measured). So both
# modes collect once after the warm steps, before the first window, and each window records the time the collector
# took in it and its full collections (``gc_seconds``, ``gc_full_collections``, through ``gc.callbacks``). Measured
# since (``reports/runs/h200-matrix-blocks-2026-12-03/``): V1's first extensible windows still took 18 and 48 ms
# longer than legacy's, with the collector at most 5 ms of that, so the collection is not the cause; the median
# ratio is 0.996 (V1) and 0.998 (V2) over two pairs.
class _CollectorTime:
    """Seconds spent in Python's garbage collector, and its full (generation 2) collections, while registered."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2
            self._start = None

    def __enter__(self) -> _CollectorTime:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def run_throughput(llm, vocab: int, num_seqs: int, warm_steps: int, steps: int, windows: int) -> dict:
    """Generated tokens per second over ``windows`` windows of ``steps`` engine steps, once all ``num_seqs``
    sequences decode (after ``warm_steps`` tokens each): decode only, no prefill in any window. ``tokens_per_s`` is
    all windows' tokens over all their seconds; each window is kept, in order, for the paired comparison (Note
    [Decode windows are paired] in ``integration/parity.py``), with the garbage collector's time in it (Note [No
    garbage from the engine's start in a window])."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    max_tokens = warm_steps + windows * steps + 16
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    for i, p in enumerate(prompts(vocab, count=num_seqs, length=THROUGHPUT_PROMPT_LEN, seed=555)):
        engine.add_request(f"throughput-{i}", {"prompt_token_ids": p}, params)
    produced: dict[str, int] = {}
    warm_start = time.perf_counter()
    while len(produced) < num_seqs or min(produced.values()) < warm_steps:
        for o in engine.step():
            produced[o.request_id] = produced.get(o.request_id, 0) + len(o.outputs[0].token_ids)
    warm_seconds = time.perf_counter() - warm_start
    gc.collect()
    results = []
    for _ in range(windows):
        with _CollectorTime() as collector:
            tokens, start = 0, time.perf_counter()
            for _ in range(steps):
                tokens += sum(len(o.outputs[0].token_ids) for o in engine.step())
            seconds = time.perf_counter() - start
        results.append(
            {
                "tokens": tokens,
                "seconds": seconds,
                "gc_seconds": round(collector.seconds, 6),
                "gc_full_collections": collector.full,
            }
        )
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "num_seqs": num_seqs,
        "prompt_len": THROUGHPUT_PROMPT_LEN,
        "warm_steps": warm_steps,
        "steps_per_window": steps,
        "windows": results,
        "warm_seconds": round(warm_seconds, 3),
        "tokens_per_s": tokens_per_s(results),
    }


def compile_cache_files() -> int | None:
    """Files under vLLM's torch.compile cache (``$VLLM_CACHE_ROOT/torch_compile_cache``), or None where vLLM does
    not say where it is. Counted before and after the engine is built: files written means this engine compiled,
    none means it loaded what an earlier engine compiled, which takes seconds off its start (Note [A start time
    needs the same compile cache] in ``integration/parity.py``)."""
    try:
        import vllm.envs as envs

        root = Path(envs.VLLM_CACHE_ROOT) / "torch_compile_cache"
    except (ImportError, AttributeError):
        return None
    return sum(len(files) for _dir, _dirs, files in os.walk(root))


# -- the case ------------------------------------------------------------------------------------------------------
def _refusal_types() -> tuple[type, ...]:
    """What an engine raises when vLLM (or the extensible path) refuses a configuration: config and backend
    validation raise ValueError (pydantic's ValidationError is one), unimplemented paths NotImplementedError."""
    from extensible_kv.vllm import ExtensibleKVUnsupported

    return ValueError, NotImplementedError, ExtensibleKVUnsupported


def refused_result(args: argparse.Namespace, exc: BaseException, seconds: float) -> dict:
    """The case file of an engine vLLM (or the extensible path) refused to build: the exception's text."""
    from extensible_kv.vllm import ExtensibleKVUnsupported

    by = "extensible_kv" if isinstance(exc, ExtensibleKVUnsupported) else "vllm"
    return {
        "case": case_of(args),
        "refused": f"{type(exc).__name__}: {exc}",
        "refused_by": by,
        "engine_seconds": round(seconds, 2),
    }


def as_written(model: Record) -> dict:
    """A phase's measurement model as the case file holds it: the fields the phase gave (by their JSON names), none
    added as ``null``."""
    return model.model_dump(by_alias=True, exclude_unset=True)


@dataclass
class Engine:
    """The engine of a case, built: how long ``LLM(...)`` took, the torch.compile cache files it wrote (Note [A start
    time needs the same compile cache] in ``integration/parity.py``; ``None`` where the count is unknown or the
    cache was pruned meanwhile), and whether its worker runs in this process (only then does ``RunnerRecord`` see
    the runner)."""

    llm: object
    seconds: float
    compile_cache_files_written: int | None
    in_process: bool


def files_written(before: int | None, after: int | None) -> int | None:
    """Compile cache files the engine wrote; ``None`` where either count is unknown or there are fewer (pruned)."""
    return None if before is None or after is None or after < before else after - before


def built_engine(args: argparse.Namespace, record: RunnerRecord) -> Engine | dict:
    """The case's engine, with ``record`` on its runner where the worker runs in this process; the refused case file
    (``refused_result``) where vLLM or the extensible path refuses the combination."""
    from vllm import LLM

    from extensible_kv.vllm import extensible_kv_cache

    kwargs = engine_kwargs(args)
    if args.tp > 1 and args.mode == "extensible":
        raise SystemExit("--tp > 1 runs every rank in its own process: use --mode plugin")
    in_process = args.mode != "plugin" and args.tp == 1  # the worker runs in this process
    if in_process:
        record_runner_memory(record)
    compiled_before = compile_cache_files()
    start = time.perf_counter()
    try:
        with extensible_kv_cache() if args.mode == "extensible" else nullcontext():
            llm = LLM(**kwargs)
    except _refusal_types() as exc:
        return refused_result(args, exc, time.perf_counter() - start)
    seconds = time.perf_counter() - start
    return Engine(llm, seconds, files_written(compiled_before, compile_cache_files()), in_process)


@dataclass
class Warmup:
    """Every rank's figures after warmup and the final commit (``memory_figures``), and every rank's extensible
    report (``extensible_kv_report``; ``None`` for legacy)."""

    memory: list[CaseMemory]
    extensible: list[ExtensibleFigures] | None

    def after_warmup(self) -> list[dict]:
        """Every rank's figures as ``integration.parity`` reads them."""
        return [as_written(m) for m in self.memory]


def warmup_figures(llm, mode: str, record: RunnerRecord | None) -> Warmup:
    """The report after warmup and the final commit. The extensible report is read after the
    ``extensible_kv_cache()`` block has exited: an engine keeps its RPCs (Note [An engine keeps its RPCs]).
    ``record``: this process's runners' (``None`` where the worker is in another process: the RPC then goes as a
    plain function, pickled as vLLM pickles every RPC, with nothing of this process's in it)."""
    reports = llm.collective_rpc("extensible_kv_report") if mode != "legacy" else None
    memory = llm.collective_rpc(memory_figures if record is None else partial(memory_figures, record=record))
    return Warmup(
        [CaseMemory.model_validate(m) for m in memory],
        # Through JSON, as a measurement file is read: the worker's report holds tuples where the schema says list.
        None if reports is None else [ExtensibleFigures.model_validate_json(json.dumps(r)) for r in reports],
    )


def measured_batch(args: argparse.Namespace, config: dict) -> list[dict]:
    """The measured pass's prompts: ``NUM_PROMPTS`` of ``prompt_len`` tokens, each with one image for a multimodal
    model. The same batch runs in the sensitivity pass."""
    if is_multimodal(config):
        return vllm_prompts(
            image_prompts(config, [prompt_len(args)] * NUM_PROMPTS, seed=1234, image_seed=IMAGE_SEEDS["measured"])
        )
    return [{"prompt_token_ids": p} for p in prompts(text_token_limit(config), length=prompt_len(args))]


def measured_passes(llm, batch: list[dict], max_tokens: int, corrupt: bool, multimodal: bool) -> dict:
    """The generation, twice over ``batch``: a one-token pass fills the prefix cache, the measured pass reads its
    cached KV blocks (``token_ids``, ``num_cached_tokens``); ``corrupt``: every committed KV block overwritten
    between the two (``corrupted_elements``). A multimodal case adds ``prompt_lens`` as vLLM counts them (images
    expanded)."""
    from vllm import SamplingParams

    warm = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
    llm.generate(batch, warm, use_tqdm=False)
    corrupted = llm.collective_rpc(corrupt_kv)[0] if corrupt else 0
    outputs = llm.generate(batch, params, use_tqdm=False)
    passes = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "num_cached_tokens": [getattr(o, "num_cached_tokens", None) for o in outputs],
        "corrupted_elements": corrupted,
    }
    if multimodal:
        passes["prompt_lens"] = [len(o.prompt_token_ids) for o in outputs]
    return passes


def throughput_phase(llm, args: argparse.Namespace, vocab: int) -> dict:
    """``throughput``: ``run_throughput`` over ``--max-num-seqs`` sequences (vLLM's own where 0)."""
    seqs = args.max_num_seqs or llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    return run_throughput(llm, vocab, seqs, args.throughput_warm_steps, args.throughput_steps, args.throughput_windows)


def speculative_phase(llm, spec: str, config: dict, warmup: Warmup) -> list[SpeculativeFigures]:
    """``memory.speculative``, every rank's: the widest speculative step (``run_speculative``), read against that
    rank's figures after warmup as the peak is (``integration.parity.speculative_figures``)."""
    readings = run_speculative(llm, text_token_limit(config), spec, config["vocab_size"])
    return [
        SpeculativeFigures.model_validate(speculative_figures(w, r)) for w, r in zip(warmup.after_warmup(), readings)
    ]


def encoder_fill_phase(llm, config: dict, budget: dict) -> int:
    """The encoder cache filled before the peak batch: ``fill_rounds`` rounds of ``max_num_seqs`` one-image requests
    (``run_encoder_fill``), enough that the peak batch's images bring it to its capacity. Returns the requests run."""
    seqs = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    held = llm.collective_rpc(encoder_cache_now)[0] or {"items": 0}
    return run_encoder_fill(llm, config, fill_rounds(budget["capacity_items"], held["items"], seqs, seqs), seqs)


def peak_phase(
    llm, config: dict, budget: dict | None, warmup: Warmup, speculative: list[SpeculativeFigures] | None
) -> list[MeasuredPeak]:
    """``memory.peak``, every rank's: the peak-shaped batch (``run_peak``; one image per prompt where the model has
    an encoder budget) read against that rank's figures after warmup and its speculative phase, the larger of the
    two (``integration.parity.peak_figures``)."""
    make_batch = image_batch(config, budget["tokens_per_item"]) if budget is not None else None
    _, readings = run_peak(llm, text_token_limit(config), make_batch)
    phases = [as_written(s) for s in speculative] if speculative else [None] * len(readings)
    return [
        MeasuredPeak.model_validate(peak_figures(w, p, s)) for w, p, s in zip(warmup.after_warmup(), readings, phases)
    ]


def encoder_cache_phase(
    llm, budget: dict, record: RunnerRecord | None, fill_requests: int
) -> EncoderCacheFigures | None:
    """``memory.encoder_cache``: the cache read now (at the measured peak where the peak batch ran) with what
    ``record`` kept; ``None`` where the worker is in another process (``record`` is ``None``: nothing was kept)."""
    at_peak = llm.collective_rpc(encoder_cache_now)[0]
    return None if record is None else encoder_cache_figures(record, budget, at_peak, fill_requests)


def sensitivity_phase(llm, batch: list[dict], max_tokens: int, clean: list[list[int]]) -> dict:
    """``sensitivity``: every committed KV block overwritten, then the measured pass again; its tokens must differ
    from the ``clean`` ones, or the parity comparison could not fail."""
    from vllm import SamplingParams

    written = llm.collective_rpc(corrupt_kv)[0]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
    dirty = llm.generate(batch, params, use_tqdm=False)
    dirty_tokens = [list(o.outputs[0].token_ids) for o in dirty]
    return {
        "corrupted_elements": written,
        "token_ids": dirty_tokens,
        "num_cached_tokens": [getattr(o, "num_cached_tokens", None) for o in dirty],
        "changed": dirty_tokens != clean,
    }


@dataclass
class Phases:
    """What the phases after warmup returned, for ``case_file``; ``None``: the phase did not run.
    ``encoder_cache_read``: the encoder cache phase ran (``memory.encoder_cache`` is then written, ``null`` where
    the runner is in another process)."""

    reinitialised: object
    passes: dict
    throughput: dict | None
    speculative: list[SpeculativeFigures] | None
    peak: list[MeasuredPeak] | None
    encoder_cache: EncoderCacheFigures | None
    encoder_cache_read: bool
    sensitivity: dict | None


def case_file(args: argparse.Namespace, engine: Engine, warmup: Warmup, phases: Phases) -> dict:
    """The case file. ``memory`` is rank 0's figures after warmup with each measured phase's added in the order they
    ran; ``ranks.memory[0]`` is that same ``memory``, the other ranks' only their figures after warmup."""
    memory = as_written(warmup.memory[0])
    reports = [as_written(r) for r in warmup.extensible] if warmup.extensible is not None else None
    ranks: dict = {
        "memory": [memory] + [as_written(m) for m in warmup.memory[1:]],
        "extensible": reports if args.tp > 1 else None,
    }
    if phases.speculative is not None:
        ranks["speculative"] = [as_written(s) for s in phases.speculative]
        memory["speculative"] = ranks["speculative"][0]
    if phases.peak is not None:
        ranks["peak"] = [as_written(p) for p in phases.peak]
        memory["peak"] = ranks["peak"][0]
    if phases.encoder_cache_read:
        memory["encoder_cache"] = None if phases.encoder_cache is None else as_written(phases.encoder_cache)
    reinit = phases.reinitialised
    passes = phases.passes
    result = {
        "case": case_of(args),
        "token_ids": passes["token_ids"],
        "num_cached_tokens": passes["num_cached_tokens"],
        "corrupted_elements": passes["corrupted_elements"],
        "reinitialised_parameters": reinit[0] if isinstance(reinit, list) else reinit,
        "engine_seconds": round(engine.seconds, 2),
        "memory": memory,
        "extensible": reports[0] if reports else None,
        "compile_cache_files_written": engine.compile_cache_files_written,
        "ranks": ranks,
    }
    if "prompt_lens" in passes:
        result["prompt_lens"] = passes["prompt_lens"]
    if phases.throughput is not None:
        result["throughput"] = phases.throughput
    if phases.sensitivity is not None:
        result["sensitivity"] = phases.sensitivity
    return result


def run(args: argparse.Namespace) -> dict:
    """The case, phase by phase in the order the module's docstring gives; returns its case file."""
    _env(args)
    config = model_config(args.model)
    if (missing := refused_import(config, args.model)) is not None:
        raise SystemExit(missing)
    record = RunnerRecord()
    engine = built_engine(args, record)
    if not isinstance(engine, Engine):
        return engine  # refused
    llm, vocab = engine.llm, text_token_limit(config)
    recorded = record if engine.in_process else None  # what this process's runners kept: nothing out of process
    warmup = warmup_figures(llm, args.mode, recorded)
    reinitialised = llm.apply_model(reinit_weights)
    budget = llm.collective_rpc(encoder_budget)[0] if is_multimodal(config) else None
    batch = measured_batch(args, config)
    encoder_read = budget is not None and (args.peak or recorded is not None)
    with record.encoder_sampling():  # the case's own steps: generation, throughput, speculative, fill, peak batch
        passes = measured_passes(llm, batch, args.max_tokens, args.corrupt, is_multimodal(config))
        throughput = throughput_phase(llm, args, vocab) if args.throughput else None
        spec = speculative_phase(llm, args.speculative, config, warmup) if args.peak and args.speculative else None
        fill = encoder_fill_phase(llm, config, budget) if args.peak and budget is not None else 0
        peak = peak_phase(llm, config, budget, warmup, spec) if args.peak else None
        encoder = encoder_cache_phase(llm, budget, recorded, fill) if encoder_read else None
    sensitive = args.sensitivity and not args.corrupt  # a corrupted measured pass has no clean tokens to differ from
    dirty = sensitivity_phase(llm, batch, args.max_tokens, passes["token_ids"]) if sensitive else None
    phases = Phases(reinitialised, passes, throughput, spec, peak, encoder, encoder_read, dirty)
    return case_file(args, engine, warmup, phases)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m integration.run_case")
    p.add_argument("--model", default="tiny-llama", choices=sorted(d.name for d in MODELS.iterdir()))
    p.add_argument("--runner", choices=["v1", "v2"], required=True)
    p.add_argument("--backend", default="FLASH_ATTN")
    p.add_argument(
        "--mode",
        choices=["legacy", "extensible", "plugin"],
        required=True,
        help="legacy: vLLM as is; extensible: in-process with the context manager; plugin: "
        "multiprocess engine switched on by EXTENSIBLE_KV_CACHE=1 through the entry point",
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype: auto (the model dtype), fp8, ...")
    p.add_argument("--block-size", type=int, default=None, help="KV block size in tokens (default: vLLM's)")
    p.add_argument("--corrupt", action="store_true", help="overwrite the committed KV blocks before the measured pass")
    p.add_argument(
        "--peak",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end with the peak-shaped batch and record memory.peak (default on)",
    )
    p.add_argument(
        "--sensitivity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="then overwrite the committed KV blocks and run the measured pass again (default on)",
    )
    p.add_argument("--batch-invariant", action="store_true", help="VLLM_BATCH_INVARIANT=1 (vLLM's deterministic mode)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--throughput", action="store_true", help="measure steady-state decode tokens/s")
    p.add_argument("--throughput-warm-steps", type=int, default=32)
    p.add_argument("--throughput-steps", type=int, default=100, help="engine steps per timed window")
    p.add_argument("--throughput-windows", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="measured prompts' length (default 40, or 2 blocks + 8 tokens for blocks over 16 tokens)",
    )
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="default: min(16384, max_num_seqs x (max_model_len - 1)), so the peak batch fills it",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=8, help="0: vLLM's default")
    p.add_argument("--capture-sizes", default="1,2,4,8", help="comma-separated; empty: vLLM's default sizes")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor_parallel_size (TP > 1 needs --mode plugin or legacy: every rank is its own process)",
    )
    p.add_argument(
        "--speculative",
        type=speculative_arg,
        default=None,
        metavar="ngram:K",
        help="speculative decoding, ngram with K drafts per step (prompt lookup 2..4); with --peak, the "
        "widest speculative step is measured before the peak batch (memory.speculative)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the case and the engine arguments; run nothing")
    p.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.dry_run:
        print(json.dumps({"case": case_of(args), "engine": engine_kwargs(args)}, indent=2))
        return 0
    result = run(args)
    out = write(args.out, IntegrationCase.model_validate_json(json.dumps(result)))
    write(out.parent / "environment.json", Environment.collect())
    brief = {"case": result["case"], "engine_seconds": result["engine_seconds"]}
    if result.get("refused"):
        brief["refused"] = result["refused"]
    else:
        brief["blocks"] = result["memory"]["num_gpu_blocks"]
        if "peak" in result["memory"]:
            brief["over_budget_measured_mib"] = result["memory"]["peak"]["over_budget_measured"] / 2**20
            brief["over_budget_phase"] = result["memory"]["peak"]["over_budget_phase"]
        if result["memory"].get("encoder_cache"):
            enc = result["memory"]["encoder_cache"]
            brief["encoder_cache_items"] = {
                k: enc[k] for k in ("profiled_items", "items_held", "items_at_peak", "capacity_items")
            }
    print(json.dumps(brief))
    return 0


if __name__ == "__main__":
    sys.exit(main())
