"""Greedy output of vLLM 0.26.0 with the extensible KV cache is byte-identical to the legacy path (GPU only).

Each case runs in a fresh process (``integration/run_case.py``) and writes its JSON under
``$EXTENSIBLE_KV_REPORT_DIR`` (default ``reports/out/integration``), which the report generator reads.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from extensible_kv_lab.parity import first_difference, refusal
from integration.parity import check_memory_budget, run_subprocess

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("EXTENSIBLE_KV_REPORT_DIR", ROOT / "reports" / "out" / "integration"))

pytestmark = [pytest.mark.gpu]


def _require_gpu_and_vllm() -> None:
    try:
        import torch
    except ImportError as exc:
        pytest.skip(f"torch is not importable: {exc}")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the vLLM integration cases need a GPU")
    pytest.importorskip("vllm", reason="vllm is not installed (install the 'vllm' extra or stage it)")


_DONE: dict[tuple[str, ...], dict] = {}


def run_case(name: str, *args: str, timeout: int = 900) -> dict:
    """Run one case in a fresh process (once per pytest session: tests share identical cases)."""
    _require_gpu_and_vllm()
    if (name, *args) in _DONE:
        return _DONE[(name, *args)]
    for stale in (OUT / f"{name}.json", OUT / f"{name}.error.txt"):
        stale.unlink(missing_ok=True)
    result = run_subprocess(OUT, name, list(args), timeout)
    assert "error" not in result and not refusal(result), (
        f"case {name} ({' '.join(args)}): {result.get('error') or refusal(result)} (log: {OUT / name}.log)"
    )
    _DONE[(name, *args)] = result
    return result


def _diff(a: list[list[int]], b: list[list[int]]) -> str:
    return first_difference(a, b) or "equal"


CASES = [(runner, backend) for runner in ("v1", "v2") for backend in ("FLASH_ATTN", "TRITON_ATTN")]


@pytest.mark.parametrize("runner,backend", CASES, ids=[f"{r}-{b}" for r, b in CASES])
def test_extensible_greedy_tokens_equal_legacy(runner, backend):
    legacy = run_case(
        f"tiny-llama-{runner}-{backend}-legacy", "--runner", runner, "--backend", backend, "--mode", "legacy"
    )
    ext = run_case(
        f"tiny-llama-{runner}-{backend}-extensible", "--runner", runner, "--backend", backend, "--mode", "extensible"
    )
    assert ext["memory"]["runner"] == runner and legacy["memory"]["runner"] == runner, (
        f"{runner}/{backend}: expected the {runner} runner, got legacy {legacy['memory']['runner']}, "
        f"extensible {ext['memory']['runner']}"
    )
    expect_parity(f"{runner}/{backend}", legacy, ext)


def expect_parity(name: str, legacy: dict, ext: dict, *, cached: bool = True) -> None:
    """The extensible run's greedy tokens equal legacy's, its measured pass read cached KV blocks (``cached``), and
    it stayed inside the memory budget."""
    assert ext["token_ids"] == legacy["token_ids"], (
        f"{name}: extensible tokens differ from legacy: {_diff(ext['token_ids'], legacy['token_ids'])}"
    )
    if cached:
        assert all(c and c >= 32 for c in ext["num_cached_tokens"]), (
            f"{name}: the measured pass must read cached KV blocks, got {ext['num_cached_tokens']}"
        )
    problems = check_memory_budget(legacy, ext)  # at the measured peak (Note [Over budget at the measured peak])
    assert not problems, f"{name}: " + "; ".join(problems)


# A realistic shape for the memory accounting: Llama-3-8B's config with dummy weights, 8K context, 64 sequences and
# vLLM's default CUDA graph capture sizes for that batch (graph pools and activation peaks of real size).
LLAMA_8B = ("--model", "llama-8b-shape", "--max-model-len", "8192", "--max-num-seqs", "64", "--capture-sizes", "")


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_llama_8b_shape_matches_legacy_within_the_budget(runner):
    legacy = run_case(f"llama-8b-shape-{runner}-legacy", *LLAMA_8B, "--runner", runner, "--mode", "legacy")
    ext = run_case(f"llama-8b-shape-{runner}-extensible", *LLAMA_8B, "--runner", runner, "--mode", "extensible")
    expect_parity(f"llama-8b-shape/{runner}", legacy, ext)


def test_corrupting_committed_kv_blocks_changes_the_tokens():
    clean = run_case(
        "tiny-llama-v2-FLASH_ATTN-extensible", "--runner", "v2", "--backend", "FLASH_ATTN", "--mode", "extensible"
    )
    dirty = run_case(
        "tiny-llama-v2-FLASH_ATTN-extensible-corrupt", "--runner", "v2", "--mode", "extensible", "--corrupt"
    )
    assert dirty["corrupted_elements"] > 0, "the corruption wrote nothing"
    assert dirty["token_ids"] != clean["token_ids"], (
        "corrupting every committed KV block left the greedy tokens unchanged: the parity check could not fail"
    )


def test_hybrid_attention_mamba_on_v1_matches_legacy():
    legacy = run_case("tiny-jamba-v1-legacy", "--model", "tiny-jamba", "--runner", "v1", "--mode", "legacy")
    ext = run_case("tiny-jamba-v1-extensible", "--model", "tiny-jamba", "--runner", "v1", "--mode", "extensible")
    expect_parity("tiny-jamba/v1", legacy, ext, cached=False)
    assert ext["extensible"]["segments"] and set(ext["extensible"]["segments"]) == {1}, (
        f"tiny-jamba/v1: hybrid buffers must be single-segment, got {ext['extensible']['segments']}"
    )


def test_entry_point_switches_a_multiprocess_engine():
    # Compared with the in-process extensible run, which the parity test compares with legacy.
    baseline = run_case(
        "tiny-llama-v2-FLASH_ATTN-extensible", "--runner", "v2", "--backend", "FLASH_ATTN", "--mode", "extensible"
    )
    plugin = run_case(
        "tiny-llama-v2-FLASH_ATTN-plugin", "--runner", "v2", "--backend", "FLASH_ATTN", "--mode", "plugin"
    )
    assert plugin["extensible"] and plugin["extensible"]["commit_seconds"] is not None, (
        f"EXTENSIBLE_KV_CACHE=1 in a multiprocess engine: expected the worker to report an extensible KV cache, "
        f"got {plugin['extensible']}"
    )
    assert plugin["token_ids"] == baseline["token_ids"], (
        f"plugin/v2: tokens differ from the in-process run: {_diff(plugin['token_ids'], baseline['token_ids'])}"
    )


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_tensor_parallel_ranks_agree_on_the_block_count():
    if _gpus() < 2:
        pytest.skip(f"tensor parallelism needs 2 GPUs, found {_gpus()}")
    legacy = run_case("tiny-llama-v1-FLASH_ATTN-tp2-legacy", "--runner", "v1", "--mode", "legacy", "--tp", "2")
    ext = run_case("tiny-llama-v1-FLASH_ATTN-tp2-plugin", "--runner", "v1", "--mode", "plugin", "--tp", "2")
    assert ext["token_ids"] == legacy["token_ids"], (
        f"TP=2: extensible tokens differ from legacy: {_diff(ext['token_ids'], legacy['token_ids'])}"
    )
    per_rank = [r["kv"]["num_blocks"] for r in ext["ranks"]["extensible"]]
    assert len(per_rank) == 2 and len(set(per_rank)) == 1, f"TP=2: ranks committed different block counts {per_rank}"
    assert per_rank[0] == ext["memory"]["num_gpu_blocks"], (
        f"TP=2: ranks committed {per_rank}, the scheduler got {ext['memory']['num_gpu_blocks']}"
    )
