"""KV connectors on a GPU, legacy and extensible: vLLM 0.26.0's ``OffloadingConnector`` (CPU offload) and
``ExampleConnector`` (blocks saved to and loaded from local storage), each case in its own process, JSON per case
and a summary table under the output folder.

    python integration/connector_run.py OUT_DIR [--cases NAME,...] [--budget-s 345] [--graphs] [--dry-run]
    python integration/connector_run.py --case NAME --out OUT_DIR      (one case, in this process)

A case is (model, runner, connector, mode): the Qwen3-0.6B-shaped local config (``integration/models``) and a tiny
dense DeepSeek-V2 (MLA attention) config written under ``OUT_DIR/models`` (``integration/models`` has no MLA model);
V1 and V2; ``none`` (no connector), ``offloading``, ``example``; legacy and extensible. The engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with dummy weights re-seeded (``run_case.reinit_weights``), prefix caching
on, ``NUM_BLOCKS`` KV blocks for the scheduler (Note [Reserved, committed]) and, unless ``--graphs``,
``enforce_eager`` (the budget: about 6 minutes for every case on an H200).

Note [Reserved, committed]
    Eviction needs a small KV cache: the legacy engine gets ``num_gpu_blocks_override = NUM_BLOCKS``. The
    extensible engine gets ``RESERVE_FACTOR x NUM_BLOCKS`` as its override, which it reserves, and its measured fit
    capped at ``NUM_BLOCKS`` (``cap_commit``), which it commits and hands to the scheduler. Both schedule the same
    blocks the same way, and the extensible connector's registration covers a committed part of a larger
    reservation, as in a real run: its registered bytes must be the committed bytes, not the reserved ones. No
    dimension of these models' KV views has either block count (``layout.block_dim`` finds the block dimension
    as the one of that size).

Traffic (``traffic``): ``PREFIXES`` shared prefixes of ``PREFIX_LEN`` tokens, each with ``SUFFIXES`` suffixes of
``SUFFIX_LEN`` tokens (``first``, ``MAX_TOKENS`` tokens each); then ``FILLERS`` unrelated prompts of
``FILLER_LEN`` tokens (``evict``, one token each: many more blocks than the GPU has, so the prefixes' blocks are
evicted from the GPU prefix cache); then the ``first`` prompts again (``again``). A connector that kept the blocks
loads them back in ``again``; without one they are recomputed.

Per case (``OUT_DIR/<case>.json``): the tokens of ``first`` and ``again`` and vLLM's ``num_cached_tokens`` of each
request; the connector's own counters (``counters``: OffloadingConnector's GPU blocks submitted for store and load,
ExampleConnector's blocks in the store and load requests of its metadata, apart the loads of a step without
attention metadata, which it skips: ``load_blocks_skipped``); every call to ``register_kv_caches`` /
``register_cross_layers_kv_cache`` (``registered``: each tensor's shape, strides and storage bytes, the distinct
storages' bytes together, and the block count the connector's config said then) against the committed KV bytes
(``committed_bytes``: the runner's KV cache on the legacy path, the extensible buffers' committed bytes on the
extensible one). An engine that vLLM or the extensible path refuses writes ``refused`` instead.

The summary (``summary.json``, ``summary.md``): per case, its tokens against the same case in the other mode and
against the same mode without a connector, the counters, and registered against committed bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # python integration/connector_run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(__file__).resolve().parent / "models"
NUM_BLOCKS = 96  # KV blocks of 16 tokens (1536 tokens) the scheduler gets, legacy and extensible alike
RESERVE_FACTOR = 4  # the extensible path reserves 4 x NUM_BLOCKS and commits NUM_BLOCKS (Note [Reserved, committed])
BLOCK = 16
MAX_MODEL_LEN, MAX_NUM_SEQS = 512, 4
PREFIXES, SUFFIXES, PREFIX_LEN, SUFFIX_LEN, MAX_TOKENS = 4, 2, 64, 24, 8
FILLERS, FILLER_LEN = 30, 160  # 30 x 10 blocks: over twice the GPU's 96 and the first prompts' 48
CPU_BYTES = 2 << 30  # OffloadingConnector's CPU pool: holds every block of the run (about 350 of 1.8 MiB)
BUDGET_S = 345
CASE_TIMEOUT_S = 150
MODEL_NAMES = {"qwen3": "qwen3-0.6b-shape", "mla": "tiny-mla"}
CONNECTORS = ("offloading", "example", "none")
MODES = ("legacy", "extensible")
# A dense DeepSeek-V2 (MLA: kv_lora_rank 512 + rope 64 = one 576-wide latent per token): every layer's MLP dense
# (first_k_dense_replace = num_hidden_layers; transformers' config refuses n_routed_experts=None, so vLLM still
# calls it MoE and the case sets the runner itself).
TINY_MLA = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "first_k_dense_replace": 4,
    "moe_intermediate_size": 1408,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}


# -- cases -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    model: str  # a key of MODEL_NAMES
    runner: str  # v1 | v2
    connector: str  # offloading | example | none
    mode: str  # legacy | extensible

    @property
    def name(self) -> str:
        return f"{self.model}-{self.runner}-{self.connector}-{self.mode}"

    @classmethod
    def parse(cls, name: str) -> Case:
        parts = name.split("-")
        case = cls(*parts) if len(parts) == 4 else None
        if (
            case is None
            or case.model not in MODEL_NAMES
            or case.runner not in ("v1", "v2")
            or case.connector not in CONNECTORS
            or case.mode not in MODES
        ):
            raise ValueError(
                f"case {name!r}: expected MODEL-RUNNER-CONNECTOR-MODE with MODEL in "
                f"{sorted(MODEL_NAMES)}, "
                f"RUNNER v1|v2, CONNECTOR in {list(CONNECTORS)}, MODE in {list(MODES)}"
            )
        return case


def all_cases() -> list[Case]:
    """Every case, most important first (a run out of time skips the tail): Qwen3 on vLLM's default runner (V2),
    then V1 (where OffloadingConnector gets cross-layer blocks), then the MLA model; per runner the connectors,
    each legacy then extensible, then the runs without a connector."""
    return [
        Case(model, runner, conn, mode)
        for model in ("qwen3", "mla")
        for runner in ("v2", "v1")
        for conn in CONNECTORS
        for mode in MODES
    ]


def model_path(model: str, out_dir: Path) -> Path:
    """The model's config folder: ``integration/models`` or, for the generated MLA config, ``out_dir/models``."""
    return MODELS / MODEL_NAMES[model] if model != "mla" else out_dir / "models" / MODEL_NAMES[model]


def write_mla_config(out_dir: Path) -> Path:
    path = model_path("mla", out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_MLA, indent=2) + "\n")
    return path


def kv_transfer_config(case: Case, out_dir: Path) -> dict | None:
    if case.connector == "offloading":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": CPU_BYTES},
        }
    if case.connector == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(out_dir / "example-storage" / case.name)},
        }
    return None


def engine_kwargs(case: Case, out_dir: Path, graphs: bool = False) -> dict:
    """The ``LLM(...)`` arguments of a case (no vLLM needed)."""
    kwargs = {
        "model": str(model_path(case.model, out_dir)),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "seed": 0,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": MAX_NUM_SEQS,
        "generation_config": "vllm",
        "enable_prefix_caching": True,
        "enforce_eager": not graphs,
        "gpu_memory_utilization": 0.5,
        "block_size": BLOCK,
        "num_gpu_blocks_override": NUM_BLOCKS * (RESERVE_FACTOR if case.mode == "extensible" else 1),
    }
    transfer = kv_transfer_config(case, out_dir)
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    return kwargs


def environment(case: Case) -> dict[str, str]:
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_USE_V2_MODEL_RUNNER": "1" if case.runner == "v2" else "0",
        "EXTENSIBLE_KV_CACHE": "0",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "NCCL_NVLS_ENABLE": "0",
    }


# -- traffic ---------------------------------------------------------------------------------------------------------
def _ids(gen, count: int, vocab: int) -> list[int]:
    return [int(gen.integers(3, vocab)) for _ in range(count)]


def traffic(vocab: int, seed: int = 1234) -> dict[str, list[list[int]]]:
    """``first`` (shared prefixes, each with its own suffixes), ``evict`` (unrelated fillers) and ``again`` (the
    ``first`` prompts once more). Token ids from ``[3, vocab)``, the same for the same seed."""
    import numpy as np

    gen = np.random.default_rng(seed)
    prefixes = [_ids(gen, PREFIX_LEN, vocab) for _ in range(PREFIXES)]
    first = [p + _ids(gen, SUFFIX_LEN, vocab) for p in prefixes for _ in range(SUFFIXES)]
    evict = [_ids(gen, FILLER_LEN, vocab) for _ in range(FILLERS)]
    return {"first": first, "evict": evict, "again": [list(p) for p in first]}


# -- what the connector is handed, and its counters -------------------------------------------------------------------
def _tensors(value: object) -> Iterable:
    if hasattr(value, "untyped_storage"):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def extent(value: object) -> dict:
    """The tensors of a ``register_*`` call: each one's shape, strides and storage bytes, and the distinct
    storages' bytes together (what a connector can reach through them)."""
    rows, storages, seen = [], {}, set()
    for t in _tensors(value):
        if id(t) in seen:
            continue
        seen.add(id(t))
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        rows.append(
            {
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "storage_bytes": storage.nbytes(),
                "offset_bytes": t.storage_offset() * t.element_size(),
            }
        )
    return {"tensors": rows, "storage_bytes": sum(storages.values()), "storages": len(storages)}


def example_blocks(metadata: object, block_size: int) -> tuple[int, int]:
    """(blocks to store, blocks to load) in one step's ExampleConnector metadata: each request's slot mapping,
    in whole blocks."""
    store = load = 0
    for request in getattr(metadata, "requests", ()):
        blocks = math.ceil(len(request.slot_mapping) / block_size)
        if request.is_store:
            store += blocks
        else:
            load += blocks
    return store, load


COUNTERS: dict = {
    "registered": [],
    "store_blocks": 0,
    "load_blocks": 0,
    "store_jobs": 0,
    "load_jobs": 0,
    "load_blocks_skipped": 0,
}


def install_recorders() -> None:
    """Record every registration and count the connectors' transfers, on the classes (the worker runs in this
    process). On the extensible path the registration reaches these wrappers once the final commit is done."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    for cls in (OffloadingConnector, ExampleConnector):
        for method in ("register_kv_caches", "register_cross_layers_kv_cache"):
            original = getattr(cls, method)

            def record(self, value, *args, _original=original, _method=method, **kwargs):
                config = getattr(self, "_kv_cache_config", None)
                COUNTERS["registered"].append(
                    {"method": _method, "connector_num_blocks": getattr(config, "num_blocks", None), **extent(value)}
                )
                return _original(self, value, *args, **kwargs)

            setattr(cls, method, record)

    init_worker = OffloadingConnectorWorker._init_worker

    def _init_worker(self, kv_caches):
        init_worker(self, kv_caches)
        worker = self.worker
        submit_store, submit_load = worker.submit_store, worker.submit_load

        def store(job_id, src_spec, dst_spec):
            COUNTERS["store_jobs"] += 1
            COUNTERS["store_blocks"] += len(src_spec.block_ids)
            return submit_store(job_id, src_spec, dst_spec)

        def load(job_id, src_spec, dst_spec):
            COUNTERS["load_jobs"] += 1
            COUNTERS["load_blocks"] += len(dst_spec.block_ids)
            return submit_load(job_id, src_spec, dst_spec)

        worker.submit_store, worker.submit_load = store, load

    OffloadingConnectorWorker._init_worker = _init_worker
    start_load_kv = ExampleConnector.start_load_kv

    def start_load(self, forward_context, **kwargs):
        if self.has_connector_metadata():
            store, load = example_blocks(self._get_connector_metadata(), self._block_size)
            COUNTERS["store_blocks"] += store
            # ExampleConnector loads nothing when the step's forward context has no attention metadata
            skipped = getattr(forward_context, "attn_metadata", None) is None
            COUNTERS["load_blocks_skipped" if skipped else "load_blocks"] += load
        return start_load_kv(self, forward_context, **kwargs)

    ExampleConnector.start_load_kv = start_load


def cap_commit(num_blocks: int) -> None:
    """The extensible engine commits at most ``num_blocks`` (Note [Reserved, committed]): its measured fit, capped."""
    from extensible_kv.vllm.sizing import MemoryState

    fit = MemoryState.blocks
    MemoryState.blocks = lambda self: min(fit(self), max(num_blocks, self.committed_blocks))


def _worker_facts(worker) -> dict:
    """The runner's KV facts: its attention backend, block count and the bytes of its KV cache tensors."""
    runner = worker.model_runner
    groups = [g for gs in getattr(runner, "attn_groups", []) for g in (gs if isinstance(gs, list) else [gs])]
    config = runner.kv_cache_config
    return {
        "backends": sorted({g.backend.__name__ for g in groups}),
        "num_blocks": config.num_blocks,
        "kv_cache_tensor_bytes": sum(t.size for t in config.kv_cache_tensors),
        "cross_layers": getattr(runner, "cross_layers_kv_cache", None) is not None,
    }


# -- one case, in this process ---------------------------------------------------------------------------------------
def run_case(case: Case, out_dir: Path, graphs: bool = False) -> dict:
    os.environ.update(environment(case))
    sys.path.insert(0, str(ROOT / "reference"))
    from contextlib import nullcontext

    from vllm import LLM, SamplingParams

    from extensible_kv.vllm import ExtensibleKVUnsupported, extensible_kv_cache
    from integration.run_case import reinit_weights

    install_recorders()
    if case.mode == "extensible":
        cap_commit(NUM_BLOCKS)
    kwargs = engine_kwargs(case, out_dir, graphs)
    start = time.perf_counter()
    try:
        with extensible_kv_cache() if case.mode == "extensible" else nullcontext():
            llm = LLM(**kwargs)
    except (ValueError, NotImplementedError, ExtensibleKVUnsupported) as exc:
        chain, by = exc, "vllm"
        while chain is not None:
            by = "extensible_kv" if isinstance(chain, ExtensibleKVUnsupported) else by
            chain = chain.__cause__
        return {
            "case": asdict(case),
            "refused": f"{type(exc).__name__}: {exc}",
            "refused_by": by,
            "engine_seconds": round(time.perf_counter() - start, 2),
        }
    engine_seconds = time.perf_counter() - start
    report = llm.collective_rpc("extensible_kv_report")[0] if case.mode == "extensible" else None
    facts = llm.collective_rpc(_worker_facts)[0]
    llm.apply_model(reinit_weights)
    vocab = json.loads((Path(kwargs["model"]) / "config.json").read_text())["vocab_size"]
    prompts = traffic(vocab)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)
    phases = {}
    for phase, sampling in (("first", params), ("evict", one), ("again", params)):
        before = {k: COUNTERS[k] for k in ("store_blocks", "load_blocks")}
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[phase]], sampling, use_tqdm=False)
        phases[phase] = {
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs] if phase != "evict" else None,
            "num_cached_tokens": [o.num_cached_tokens for o in outputs],
            "store_blocks": COUNTERS["store_blocks"] - before["store_blocks"],
            "load_blocks": COUNTERS["load_blocks"] - before["load_blocks"],
        }
    committed = report["kv"]["committed_bytes"] if report else facts["kv_cache_tensor_bytes"]
    return {
        "case": asdict(case),
        "engine": {k: v for k, v in kwargs.items() if k != "model"},
        "engine_seconds": round(engine_seconds, 2),
        "facts": facts,
        "phases": phases,
        "counters": {
            k: COUNTERS[k] for k in ("store_blocks", "load_blocks", "store_jobs", "load_jobs", "load_blocks_skipped")
        },
        "registered": COUNTERS["registered"],
        "committed_bytes": committed,
        "extensible": None
        if report is None
        else {"kv": report.get("kv"), "connector": report.get("connector"), "events": report.get("events")},
    }


# -- the summary -----------------------------------------------------------------------------------------------------
def _key(case: dict, **change) -> str:
    return Case(**{**case, **change}).name


def _same(a: dict | None, b: dict | None) -> bool | None:
    if not a or not b or "phases" not in a or "phases" not in b:
        return None
    return all(a["phases"][p]["token_ids"] == b["phases"][p]["token_ids"] for p in ("first", "again"))


def summarize(results: dict[str, dict]) -> list[dict]:
    """One row per case: tokens against the other mode and against no connector, the counters of ``again``, and
    registered against committed bytes."""
    rows = []
    for name, r in results.items():
        case = r.get("case") or asdict(Case.parse(name))
        row = {"case": name, "status": "ok" if "phases" in r else r.get("refused") or r.get("error", "?")}
        if "phases" in r:
            other = results.get(_key(case, mode="extensible" if case["mode"] == "legacy" else "legacy"))
            bare = results.get(_key(case, connector="none")) if case["connector"] != "none" else None
            registered = r["registered"][-1]["storage_bytes"] if r["registered"] else None
            row.update(
                backend=",".join(r["facts"]["backends"]),
                blocks=r["facts"]["num_blocks"],
                same_as_other_mode=_same(r, other),
                same_as_no_connector=_same(r, bare),
                stored=r["counters"]["store_blocks"],
                loaded_again=r["phases"]["again"]["load_blocks"],
                cached_again=sum(n or 0 for n in r["phases"]["again"]["num_cached_tokens"]),
                registered_bytes=registered,
                committed_bytes=r["committed_bytes"],
                reserved_bytes=((r.get("extensible") or {}).get("kv") or {}).get("reserved_bytes"),
                extent_exact=None if registered is None else registered == r["committed_bytes"],
                registrations=len(r["registered"]),
            )
        rows.append(row)
    return rows


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return str(value)


COLUMNS = (
    "case",
    "status",
    "backend",
    "blocks",
    "same_as_other_mode",
    "same_as_no_connector",
    "stored",
    "loaded_again",
    "cached_again",
    "registered_bytes",
    "committed_bytes",
    "reserved_bytes",
    "extent_exact",
)


def table(rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)).replace("|", "/")[:120] for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


# -- the orchestrator ------------------------------------------------------------------------------------------------
def run_all(out_dir: Path, cases: Sequence[Case], budget_s: float, graphs: bool) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_mla_config(out_dir)
    start = time.perf_counter()
    results: dict[str, dict] = {}
    for case in cases:
        left = budget_s - (time.perf_counter() - start)
        path = out_dir / f"{case.name}.json"
        if left < 20:
            results[case.name] = {"case": asdict(case), "error": "skipped: out of time"}
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case.name, "--out", str(out_dir)] + (
            ["--graphs"] if graphs else []
        )
        began = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd,
                check=False,
                capture_output=True,
                text=True,
                timeout=min(CASE_TIMEOUT_S, left),
                start_new_session=True,
            )
            (out_dir / f"{case.name}.log").write_text(proc.stdout[-20000:] + proc.stderr[-40000:])
            if proc.returncode == 0 and path.exists():
                results[case.name] = json.loads(path.read_text())
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                results[case.name] = {"case": asdict(case), "error": f"exit {proc.returncode}: {tail[0][:300]}"}
        except subprocess.TimeoutExpired:
            results[case.name] = {"case": asdict(case), "error": f"timeout after {min(CASE_TIMEOUT_S, left):.0f} s"}
        results[case.name]["wall_seconds"] = round(time.perf_counter() - began, 1)
        print(
            f"{case.name}: {results[case.name].get('error') or results[case.name].get('refused') or 'ok'} "
            f"({results[case.name]['wall_seconds']} s)",
            flush=True,
        )
    rows = summarize(results)
    (out_dir / "summary.json").write_text(
        json.dumps({"rows": rows, "seconds": round(time.perf_counter() - start, 1), "num_blocks": NUM_BLOCKS}, indent=2)
        + "\n"
    )
    (out_dir / "summary.md").write_text(table(rows))
    print(table(rows))
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python integration/connector_run.py")
    p.add_argument("out_dir", nargs="?", help="output folder (every case)")
    p.add_argument("--case", help="run one case in this process (MODEL-RUNNER-CONNECTOR-MODE)")
    p.add_argument("--out", help="with --case: the output folder")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all, most important first)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="stop starting cases after this many seconds")
    p.add_argument("--graphs", action="store_true", help="capture CUDA graphs (default: enforce_eager)")
    p.add_argument("--dry-run", action="store_true", help="print the cases and their engine arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.case:
        if not args.out:
            raise SystemExit("--case needs --out")
        out = Path(args.out)
        case = Case.parse(args.case)
        result = run_case(case, out, args.graphs)
        (out / f"{case.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        return 0
    if not args.out_dir:
        raise SystemExit("give an output folder (or --case NAME --out DIR)")
    cases = [Case.parse(n) for n in args.cases.split(",") if n] or all_cases()
    out = Path(args.out_dir)
    if args.dry_run:
        print(
            json.dumps(
                [{"case": c.name, "env": environment(c), "engine": engine_kwargs(c, out, args.graphs)} for c in cases],
                indent=2,
            )
        )
        return 0
    run_all(out, cases, args.budget_s, args.graphs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
