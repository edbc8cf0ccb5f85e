"""The pure parts of ``integration/connector_run.py`` (the KV connector run on a GPU): its cases, traffic, engine
arguments, what it records of a registration and of a connector's metadata, and its summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from integration import connector_run as run

MODELS = Path(__file__).resolve().parents[2] / "integration" / "models"


def test_every_case_once_most_important_first_and_names_round_trip():
    cases = run.all_cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names)) == 2 * 2 * 3 * 2, names
    assert names[:2] == ["qwen3-v2-offloading-legacy", "qwen3-v2-offloading-extensible"], names[:2]
    assert [run.Case.parse(n) for n in names] == cases


@pytest.mark.parametrize(
    "name",
    [
        "qwen3-v3-none-legacy",
        "qwen3-v1-lmcache-legacy",
        "llama-v1-none-legacy",
        "qwen3-v1-none",
        "qwen3-v1-none-legacy-x",
    ],
)
def test_a_bad_case_name_is_refused_naming_it(name):
    with pytest.raises(ValueError, match=f"case {name!r}"):
        run.Case.parse(name)


def test_traffic_shares_prefixes_evicts_every_block_and_repeats_the_first_prompts():
    got = run.traffic(vocab=1000)
    first, evict, again = got["first"], got["evict"], got["again"]
    assert len(first) == run.PREFIXES * run.SUFFIXES and {len(p) for p in first} == {run.PREFIX_LEN + run.SUFFIX_LEN}
    prefixes = [tuple(p[: run.PREFIX_LEN]) for p in first]
    assert len(set(prefixes)) == run.PREFIXES and all(prefixes.count(p) == run.SUFFIXES for p in prefixes), (
        "each prefix must be shared by its suffixes"
    )
    assert len({tuple(p) for p in first}) == len(first), "every first prompt must be its own"
    assert again == first and again is not first
    evicting = len(evict) * math.ceil(run.FILLER_LEN / run.BLOCK)
    held = len(first) * math.ceil((run.PREFIX_LEN + run.SUFFIX_LEN) / run.BLOCK)
    assert evicting >= 2 * (run.NUM_BLOCKS + held), (
        f"the fillers take {evicting} blocks; to evict the first prompts' {held} from {run.NUM_BLOCKS} GPU blocks "
        f"they must take at least twice both"
    )
    assert not {tuple(p[: run.PREFIX_LEN]) for p in evict} & set(prefixes), "a filler shares a prefix"
    assert all(3 <= t < 1000 for p in first + evict for t in p)
    assert run.traffic(vocab=1000) == got, "the traffic must be the same for the same seed"


def test_engine_arguments_per_connector(tmp_path):
    case = run.Case("qwen3", "v1", "offloading", "extensible")
    kwargs = run.engine_kwargs(case, tmp_path)
    assert kwargs["kv_transfer_config"]["kv_connector"] == "OffloadingConnector"
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"]["cpu_bytes_to_use"] == run.CPU_BYTES
    assert (kwargs["num_gpu_blocks_override"], kwargs["enable_prefix_caching"], kwargs["enforce_eager"]) == (
        run.RESERVE_FACTOR * run.NUM_BLOCKS,
        True,
        True,
    ), kwargs
    assert run.RESERVE_FACTOR > 1, "the extensible engine must reserve more blocks than it commits"
    assert run.engine_kwargs(case, tmp_path, graphs=True)["enforce_eager"] is False
    example = run.engine_kwargs(run.Case("mla", "v2", "example", "legacy"), tmp_path)
    assert example["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"] == str(
        tmp_path / "example-storage" / "mla-v2-example-legacy"
    ), example
    assert example["model"] == str(tmp_path / "models" / "tiny-mla")
    assert example["num_gpu_blocks_override"] == run.NUM_BLOCKS, "legacy gets the scheduler's block count"
    assert "kv_transfer_config" not in run.engine_kwargs(run.Case("qwen3", "v2", "none", "legacy"), tmp_path)
    assert run.environment(run.Case("qwen3", "v2", "none", "legacy"))["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert run.environment(run.Case("qwen3", "v1", "none", "legacy"))["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_the_block_counts_are_no_other_dimension_of_the_models_kv_views(tmp_path):
    # The extensible path finds a view's block dimension as its one dimension of the reserved count.
    qwen = json.loads((MODELS / "qwen3-0.6b-shape" / "config.json").read_text())
    mla = json.loads(run.write_mla_config(tmp_path).joinpath("config.json").read_text())
    dims = {
        2,
        run.BLOCK,
        qwen["num_key_value_heads"],
        qwen["head_dim"],
        2 * qwen["head_dim"],
        qwen["num_hidden_layers"],
        mla["num_hidden_layers"],
        mla["kv_lora_rank"] + mla["qk_rope_head_dim"],
    }
    for blocks in (run.NUM_BLOCKS, run.RESERVE_FACTOR * run.NUM_BLOCKS):
        assert blocks not in dims, (blocks, sorted(dims))
    assert mla["first_k_dense_replace"] == mla["num_hidden_layers"], "the MLA model must be dense (no MoE layer)"


def test_extent_counts_each_storage_once():
    a = torch.zeros(4 * 64, dtype=torch.int8)
    b = torch.zeros(4 * 32, dtype=torch.int8)
    k = a.view(4, 64)
    got = run.extent({"l0": k, "l1": k, "l2": [a.view(4, 2, 32)[:, 0], a.view(4, 2, 32)[:, 1]], "l3": b})
    assert (got["storage_bytes"], got["storages"], len(got["tensors"])) == (4 * 64 + 4 * 32, 2, 4), got
    assert [t["offset_bytes"] for t in got["tensors"]] == [0, 0, 32, 0], got["tensors"]


def test_example_connector_blocks_are_whole_blocks_of_each_request():
    metadata = SimpleNamespace(
        requests=[
            SimpleNamespace(slot_mapping=[0] * 40, is_store=True),
            SimpleNamespace(slot_mapping=[0] * 33, is_store=False),
            SimpleNamespace(slot_mapping=[0] * 16, is_store=False),
        ]
    )
    assert run.example_blocks(metadata, 16) == (3, 4)
    assert run.example_blocks(SimpleNamespace(), 16) == (0, 0)


def _result(case: str, first, again, registered=100, committed=100, loaded=0):
    phases = {
        "first": {"token_ids": first},
        "evict": {"token_ids": None},
        "again": {"token_ids": again, "num_cached_tokens": [32, None], "load_blocks": loaded},
    }
    return {
        "case": vars(run.Case.parse(case)),
        "phases": phases,
        "facts": {"backends": ["FLASH_ATTN"], "num_blocks": 96},
        "counters": {"store_blocks": 9, "load_blocks": loaded},
        "registered": [{"storage_bytes": registered}] if registered is not None else [],
        "committed_bytes": committed,
    }


def test_summary_compares_modes_and_no_connector_and_extents():
    results = {
        "qwen3-v2-offloading-legacy": _result("qwen3-v2-offloading-legacy", [[1]], [[2]], loaded=5),
        "qwen3-v2-offloading-extensible": _result("qwen3-v2-offloading-extensible", [[1]], [[2]], 100, 90, 5),
        "qwen3-v2-none-legacy": _result("qwen3-v2-none-legacy", [[1]], [[3]], registered=None),
        "qwen3-v2-none-extensible": {
            "case": vars(run.Case.parse("qwen3-v2-none-extensible")),
            "refused": "ExtensibleKVUnsupported: no",
        },
    }
    rows = {r["case"]: r for r in run.summarize(results)}
    legacy, ext = rows["qwen3-v2-offloading-legacy"], rows["qwen3-v2-offloading-extensible"]
    assert (legacy["same_as_other_mode"], legacy["same_as_no_connector"], legacy["extent_exact"]) == (
        True,
        False,
        True,
    ), legacy
    assert (ext["same_as_no_connector"], ext["extent_exact"], ext["loaded_again"], ext["cached_again"]) == (
        None,
        False,
        5,
        32,
    ), ext
    assert rows["qwen3-v2-none-extensible"]["status"] == "ExtensibleKVUnsupported: no"
    text = run.table(run.summarize(results))
    assert text.count("\n") == 2 + len(results) and "| NO |" in text, text


def test_dry_run_prints_every_case_and_runs_nothing(tmp_path, capsys):
    assert run.main([str(tmp_path), "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [p["case"] for p in printed] == [c.name for c in run.all_cases()]
    assert not any(tmp_path.iterdir()), "a dry run must write nothing"


def test_the_extensible_commit_is_capped_at_the_schedulers_block_count(monkeypatch):
    from extensible_kv.vllm import sizing

    monkeypatch.setattr(sizing.MemoryState, "blocks", lambda self: 10_000)
    run.cap_commit(run.NUM_BLOCKS)
    assert sizing.MemoryState.blocks(SimpleNamespace(committed_blocks=1)) == run.NUM_BLOCKS
    assert sizing.MemoryState.blocks(SimpleNamespace(committed_blocks=200)) == 200, "never below what is committed"
