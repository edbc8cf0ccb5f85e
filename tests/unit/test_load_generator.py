"""The adversarial load's bursts (``integration/load_generator.py``), drawn on the CPU: seeded, within the engine's
limits, reaching every extreme the sizing must survive, and drawn without the sizing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from integration.load_generator import KINDS, Shape, plan

ROOT = Path(__file__).resolve().parents[2]
ISSUE = Shape(max_model_len=512, max_num_seqs=32, max_num_batched_tokens=4096, vocab=102_400)


def _flat(bursts):
    return [(b.kind, b.passes, b.sleep_level, [(r.prompt, r.max_tokens) for r in b.requests]) for b in bursts]


def test_the_same_seed_draws_the_same_load_and_another_seed_another():
    assert _flat(plan(ISSUE, 7, 60)) == _flat(plan(ISSUE, 7, 60))
    assert _flat(plan(ISSUE, 7, 60)) != _flat(plan(ISSUE, 8, 60))


@pytest.mark.parametrize("shape", [ISSUE, Shape(4096, 8, 16384, 151_936), Shape(2, 1, 16, 4)])
def test_every_request_fits_max_model_len(shape):
    for b in plan(shape, 3, 200, sleep_every=25):
        for r in b.requests:
            assert 1 <= len(r.prompt) and len(r.prompt) + r.max_tokens <= shape.max_model_len, (b.kind, len(r.prompt))
            assert all(3 <= t < shape.vocab for t in r.prompt)


def test_two_hundred_bursts_reach_every_extreme():
    # the extremes: prompts of max_model_len - 1, every sequence decoding to max_model_len, prefix hits then short
    # chunks over a long shared context, a second pass over cached prompts, more requests than sequences, sleep cycles
    L, S = ISSUE.max_model_len, ISSUE.max_num_seqs
    bursts = plan(ISSUE, 41, 200, sleep_every=25)
    assert {b.kind for b in bursts} == set(KINDS)
    assert any(b.kind == "max_len_prompts" and len(b.requests) == S for b in bursts)
    assert any(all(len(r.prompt) == L - 1 for r in b.requests) for b in bursts)
    decode = [b for b in bursts if b.kind == "decode_to_max_len"]
    assert decode and all(len(r.prompt) + r.max_tokens == L for b in decode for r in b.requests)
    shared = next(b for b in bursts if b.kind == "shared_prefix")
    prefix = len(_common_prefix([r.prompt for r in shared.requests]))
    assert prefix >= L // 2 and all(len(r.prompt) - prefix <= 8 for r in shared.requests)
    chunks = [b for b in bursts if b.kind == "cached_prefix_new_chunks"]
    spread = [len(r.prompt) - len(_common_prefix([r.prompt for r in b.requests])) for b in chunks for r in b.requests]
    assert all(b.passes == 2 for b in chunks) and min(spread) <= 8 and max(spread) >= L // 3
    assert any(b.passes == 2 and min(len(r.prompt) for r in b.requests) >= 0.7 * L for b in bursts)
    assert any(len(b.requests) >= 4 * S and min(len(r.prompt) for r in b.requests) >= L // 2 for b in bursts)
    sleeps = [b.sleep_level for b in bursts if b.sleep_level is not None]
    assert len(sleeps) == 7 and set(sleeps) <= {1, 2}
    assert [b for b in plan(ISSUE, 41, 200) if b.sleep_level is not None] == []


def _common_prefix(prompts):
    out = []
    for column in zip(*prompts):
        if len(set(column)) > 1:
            break
        out.append(column[0])
    return out


def test_a_shape_no_load_fits_is_refused_naming_it():
    with pytest.raises(ValueError, match="no load fits Shape"):
        plan(Shape(1, 1, 1, 100), 0, 1)


def test_the_generator_never_imports_the_sizing():
    # what it measures must not depend on what it tests: drawing and listing the load loads no extensible_kv module
    code = (
        "import sys, integration.load_generator as g; g.main(['--max-model-len', '64', '--max-num-seqs', '2', "
        "'--batches', '10']); print(sorted(m for m in sys.modules if m.split('.')[0] == 'extensible_kv'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 11 and all(json.loads(line)["kind"] in KINDS for line in lines[:10])
    assert lines[-1] == "[]", f"the load generator imported {lines[-1]}"


class _Engine:
    """``LLMEngine``'s add_request / step / has_unfinished_requests: every request ends after one step."""

    def __init__(self):
        self.live = []

    def add_request(self, name, prompt, params):
        self.live.append(name)

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        self.live = []
        return []


class _LLM:
    """An offline ``LLM`` whose worker readings are scripted: step ``i`` peaks at ``allocated[i]`` live bytes and
    ``over[i]`` bytes over the budget."""

    def __init__(self, allocated, over):
        self.llm_engine, self.allocated, self.over, self.at = _Engine(), allocated, over, 0

    def collective_rpc(self, fn):
        from integration import load_generator as g

        if fn is not g._reading:
            return [None]
        i, self.at = self.at, self.at + 1
        return [{"over_budget": self.over[i], "peak_allocated": self.allocated[i], "steps": [{"step": i}]}]


def test_the_load_names_the_step_with_the_most_live_tensors_apart_from_the_highest_over_budget():
    pytest.importorskip("vllm")
    from integration.load_generator import drive

    bursts = plan(ISSUE, 5, 3)
    steps = sum(b.passes for b in bursts)
    allocated = [100] * steps
    over = [-5] * steps
    allocated[1], over[-1] = 900, 7  # the most live tensors in one step, the highest reading in another
    report = drive(_LLM(allocated, over), bursts, seed=5)
    assert report.highest_allocated["peak_allocated"] == 900 and report.highest_allocated["steps"] == [{"step": 1}]
    assert report.highest_over_budget == 7 and report.highest["reading"]["steps"] == [{"step": steps - 1}]
