"""The per-rank bytes of a speculative step's logits (``extensible_kv.vllm.logits``) against the tensor-parallel
all-gather itself, run over gloo on the CPU with ``tp`` processes and the operations of vLLM 0.26.0's
``DeviceCommunicatorBase.all_gather(logits, dim=-1)``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from extensible_kv.vllm.logits import GatheredLogits, padded_vocab, speculative_rows

ROOT = Path(__file__).resolve().parents[2]

RANK = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist

    rank, tp, rows, vocab, store, out = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                         sys.argv[5], sys.argv[6])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp)
    full = torch.arange(rows * vocab, dtype=torch.bfloat16).reshape(rows, vocab)  # what one unsharded head computes
    shard = full[:, rank * vocab // tp:(rank + 1) * vocab // tp].clone()  # this rank's LM head output
    # vLLM 0.26.0, DeviceCommunicatorBase.all_gather(input_, dim=-1) for a [rows, vocab / tp] input:
    buffer = torch.empty((rows * tp, vocab // tp), dtype=shard.dtype)
    dist.all_gather_into_tensor(buffer, shard)
    gathered = buffer.reshape((tp, rows, vocab // tp)).movedim(0, 1).reshape(rows, vocab)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (shard, buffer, gathered)}
    json.dump({"alive": sum(storages.values()), "shard": shard.untyped_storage().nbytes(),
               "buffer": buffer.untyped_storage().nbytes(),
               "copied": gathered.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr(),
               "held": gathered.untyped_storage().nbytes(), "equal": bool(torch.equal(gathered, full))}, open(out, "w"))
    dist.destroy_process_group()
""")


def _gather(tmp_path: Path, tp: int, rows: int, vocab: int) -> list[dict]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    store = tmp_path / f"store-{tp}-{rows}"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tp), str(rows), str(vocab), str(store),
                               str(tmp_path / f"r{r}.json")], env=dict(os.environ, OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(tp)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"gather rank {r} of {tp}: exit {p.returncode}\n{text[-3000:]}"
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(tp)]


@pytest.mark.parametrize("tp,requests,k", [(2, 3, 4), (4, 2, 3), (2, 1, 0)])
def test_gathered_logits_bytes_are_what_the_all_gather_holds_on_each_rank(tmp_path, tp, requests, k):
    # A vocabulary of 1000 pads to 1024; bfloat16 logits. Every rank ends with the full-vocabulary logits, and while
    # the reshape copies them it holds its shard, the gather buffer and the copy.
    rows, vocab = speculative_rows(requests, k), padded_vocab(1000)
    expected = GatheredLogits(rows=rows, vocab=vocab, tp=tp, itemsize=2)
    results = _gather(tmp_path, tp, rows, vocab)
    for rank, got in enumerate(results):
        figures = (got["equal"], got["shard"], got["buffer"], got["alive"], got["held"])
        want = (True, expected.shard, expected.gathered, expected.peak, expected.held)
        assert figures == want, f"all-gather of {rows} rows x {vocab} on rank {rank} of {tp} (equal, shard, buffer, " \
                                f"alive, held): GatheredLogits says {want}, the gather held {figures}"
        assert got["copied"] == (expected.reordered > 0), \
            f"all-gather of {rows} rows on rank {rank} of {tp}: GatheredLogits.reordered={expected.reordered}, the " \
            f"reshape {'copied' if got['copied'] else 'made a view'}"


def test_each_rank_holds_the_full_vocabulary_whatever_the_tensor_parallelism():
    # rows x Vp x itemsize x (2 + 1/tp) per rank while gathering, the full rows x Vp afterwards; summed over the ranks
    # the gather grows with their number.
    rows, vocab = speculative_rows(256, 4), padded_vocab(151936)
    per_rank = {tp: GatheredLogits(rows=rows, vocab=vocab, tp=tp, itemsize=2) for tp in (1, 2, 4, 8)}
    unit = rows * vocab * 2
    got = {tp: (g.peak, g.held) for tp, g in per_rank.items()}
    expected = {1: (unit, unit), 2: (unit * 5 // 2, unit), 4: (unit * 9 // 4, unit), 8: (unit * 17 // 8, unit)}
    assert got == expected, f"GatheredLogits (peak, held) per tp: expected {expected}, got {got}"
    totals = [tp * per_rank[tp].peak for tp in (1, 2, 4, 8)]
    assert totals == sorted(totals) and len(set(totals)) == 4, f"summed over ranks the gather must grow with tp: " \
                                                                f"{totals}"


@pytest.mark.parametrize("call", [lambda: padded_vocab(0), lambda: speculative_rows(0, 3), lambda: speculative_rows(4, -1),
                                  lambda: GatheredLogits(rows=4, vocab=1000, tp=3, itemsize=2)],
                         ids=["vocab-0", "no-requests", "negative-k", "vocab-not-divisible-by-tp"])
def test_logits_arithmetic_refuses_impossible_shapes(call):
    with pytest.raises(ValueError, match="got"):
        call()


@pytest.mark.parametrize("vocab,expected", [(1, 64), (1000, 1024), (1024, 1024), (151936, 151936), (128256, 128256),
                                            (32001, 32064)])
def test_the_lm_head_pads_the_vocabulary_to_a_multiple_of_64(vocab, expected):
    # vLLM 0.26.0's pad_vocab_size(vocab, DEFAULT_VOCAB_PADDING_SIZE=64), whatever the tensor parallelism
    assert padded_vocab(vocab) == expected, f"padded_vocab({vocab}): expected {expected}, got {padded_vocab(vocab)}"
