"""The two case kinds for memory no profile sees, without a GPU or vLLM: multimodal (``tiny-mm``: prompts with one
image each, the encoder cache filled and read) and speculative decoding (``--speculative ngram:K``: the engine
arguments, the widest-step phase, vLLM's V2 refusal, the over-budget figure as the larger of two phases), and the
matrix's new cases. vLLM is faked where ``run_case`` calls it; the figures come from hand-made readings."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from extensible_kv_lab.measurements import IntegrationCase, SpeculativeFigures
from extensible_kv_lab.parity import REFUSED, classify_with_fallback
from integration import matrix, parity, run_case
from integration.parity import MIB, Case

ROOT = Path(__file__).resolve().parents[1]
MM = run_case.model_config("tiny-mm")
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# vLLM 0.26.0's own words (config/vllm.py, _validate_v2_model_runner), raised in VllmConfig's validation.
V2_NGRAM = "Model Runner V2 does not yet support: ngram/ngram_gpu speculative decoding"


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )


def _dry_run(*argv: str) -> dict:
    proc = _python("-m", "integration.run_case", *argv, "--dry-run", "--out", "x")
    assert proc.returncode == 0, (
        f"run_case {' '.join(argv)} --dry-run: expected exit 0, got {proc.returncode}: {proc.stderr[-800:]}"
    )
    return json.loads(proc.stdout)


# -- engine arguments ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_multimodal_case_gets_its_tokenizer_and_one_image_per_prompt(runner):
    plan = _dry_run("--model", "tiny-mm", "--runner", runner, "--mode", "extensible", "--max-model-len", "4096")
    engine, case = plan["engine"], plan["case"]
    got = (engine.get("skip_tokenizer_init"), engine.get("limit_mm_per_prompt"), "speculative_config" in engine)
    assert got == (False, {"image": 1, "video": 0}, False), (
        f"dry-run of tiny-mm on {runner}: expected (skip_tokenizer_init, limit_mm_per_prompt, speculative) = "
        f"(False, {{'image': 1, 'video': 0}}, False), got {got}"
    )
    assert (case["multimodal"], case["speculative"], engine["max_num_batched_tokens"]) == (True, None, 16384), (
        f"dry-run of tiny-mm: expected a multimodal case without speculation at 16384 batched tokens, got {case}"
    )


@pytest.mark.parametrize("mode", ["legacy", "extensible"])
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_ngram_speculation_goes_to_legacy_and_extensible_engines_alike(mode, runner):
    plan = _dry_run("--model", "qwen3-0.6b-shape", "--runner", runner, "--mode", mode, "--speculative", "ngram:4")
    engine = plan["engine"]
    assert engine.get("speculative_config") == SPEC_CONFIG, (
        f"dry-run {mode}/{runner} --speculative ngram:4: expected speculative_config {SPEC_CONFIG}, got "
        f"{engine.get('speculative_config')}"
    )
    assert plan["case"]["speculative"] == "ngram:4" and plan["case"]["multimodal"] is False, plan["case"]
    assert engine["skip_tokenizer_init"] is True and "limit_mm_per_prompt" not in engine, (
        f"dry-run of a text model: expected no tokenizer and no image limit, got {engine}"
    )


def test_a_text_case_without_the_flag_has_no_speculation():
    engine = _dry_run("--model", "qwen3-0.6b-shape", "--runner", "v1", "--mode", "legacy")["engine"]
    assert "speculative_config" not in engine, (
        f"dry-run without --speculative: expected no speculative_config, got {engine.get('speculative_config')}"
    )


@pytest.mark.parametrize("value", ["eagle:3", "ngram", "ngram:0", "ngram:x", "ngram4"])
def test_the_speculative_flag_takes_ngram_with_k_drafts_only(value):
    proc = _python(
        "-m", "integration.run_case", "--runner", "v1", "--mode", "legacy", "--speculative", value, "--out", "x"
    )
    assert proc.returncode == 2 and "expected ngram:K with K >= 1" in proc.stderr, (
        f"run_case --speculative {value}: expected exit 2 naming ngram:K, got {proc.returncode}: {proc.stderr[-300:]}"
    )


# -- prompts with images -------------------------------------------------------------------------------------------
def _phases() -> dict[str, list[dict]]:
    """The image prompts of one case as run() and the peak batch build them (measured pass, two fill rounds of 8,
    the peak batch of 8 x 2,048 tokens at 576 tokens per image)."""
    lengths = run_case.peak_batch_lengths(16384, 8, 4096)
    return {
        "measured": run_case.image_prompts(MM, [40] * 4, seed=1234, image_seed=run_case.IMAGE_SEEDS["measured"]),
        **{
            f"fill{r}": run_case.image_prompts(
                MM, [run_case.FILL_TEXT_LEN] * 8, seed=6000 + r, image_seed=run_case.IMAGE_SEEDS["fill"] + r * 8
            )
            for r in range(2)
        },
        "peak": run_case.image_prompts(
            MM, run_case.image_text_lengths(lengths, 576), seed=4321, image_seed=run_case.IMAGE_SEEDS["peak"]
        ),
    }


def test_every_image_prompt_has_one_image_pad_between_its_markers_and_text_below_them():
    for phase, specs in _phases().items():
        for i, spec in enumerate(specs):
            ids = spec["prompt_token_ids"]
            assert ids.count(1022) == 1, f"{phase} prompt {i}: expected one image_pad (1022), got {ids.count(1022)}"
            at = ids.index(1022)
            assert ids[at - 1 : at + 2] == [1020, 1022, 1021], (
                f"{phase} prompt {i}: expected vision_start, image_pad, vision_end, got {ids[at - 1 : at + 2]}"
            )
            text = ids[: at - 1] + ids[at + 2 :]
            bad = [t for t in text if not 3 <= t < 1020]
            assert not bad, f"{phase} prompt {i}: text ids must come from [3, 1020), got {bad[:5]}"


def test_every_image_of_a_case_is_distinct_and_the_peak_batch_fills_the_batched_tokens():
    phases = _phases()
    seeds = [s["image_seed"] for specs in phases.values() for s in specs]
    assert len(seeds) == 28 and len(set(seeds)) == 28, (
        f"image seeds of one case: expected 28 distinct (4 measured, 16 fill, 8 peak), got {sorted(seeds)}"
    )
    expanded = [len(s["prompt_token_ids"]) - 1 + 576 for s in phases["peak"]]  # vLLM: one image_pad -> 576
    assert expanded == [2048] * 8, f"peak batch, images expanded: expected 8 prompts of 2048 tokens, got {expanded}"
    assert [len(s["prompt_token_ids"]) for s in phases["measured"]] == [43] * 4, "measured: 40 text + 3 markers"
    with pytest.raises(ValueError, match="a prompt shorter than its image"):
        run_case.image_prompts(MM, run_case.image_text_lengths([500], 576), seed=1, image_seed=1)


def test_images_are_square_rgb_and_the_same_only_for_the_same_seed():
    specs = run_case.image_prompts(MM, [4, 4], seed=1, image_seed=77)
    prompts = run_case.vllm_prompts(specs) + run_case.vllm_prompts(specs[:1])
    images = [p["multi_modal_data"]["image"] for p in prompts]
    got = [(im.size, im.mode) for im in images]
    assert got == [((224, 224), "RGB")] * 3, f"vllm_prompts: expected 224 x 224 RGB images, got {got}"
    assert images[0].tobytes() != images[1].tobytes(), "images of seeds 77 and 78 must differ"
    assert images[0].tobytes() == images[2].tobytes(), "the image of one seed must be the same every time"
    assert prompts[0]["prompt_token_ids"] == specs[0]["prompt_token_ids"]
    assert run_case.vllm_prompts([{"prompt_token_ids": [5, 6]}]) == [{"prompt_token_ids": [5, 6]}]


def test_text_token_limit_stops_below_the_image_markers():
    qwen = run_case.model_config("qwen3-0.6b-shape")
    got = (run_case.text_token_limit(MM), run_case.text_token_limit(qwen))
    assert got == (1020, 151936), f"text_token_limit(tiny-mm, qwen3): expected (1020, 151936), got {got}"


@pytest.mark.parametrize(
    "capacity,held,peak,per_round,expected",
    [
        (28, 4, 8, 8, 2),  # tiny-mm at 16,384 batched tokens: 4 measured + 2 x 8 + 8 peak = 28
        (28, 0, 8, 8, 3),  # 20 missing: three rounds (the cache evicts what does not fit, oldest first)
        (28, 20, 8, 8, 0),
        (28, 30, 8, 8, 0),
        (7, 0, 8, 8, 0),
        (28, 4, 8, 0, 0),
    ],
)
def test_fill_rounds_bring_the_encoder_cache_to_its_capacity(capacity, held, peak, per_round, expected):
    got = run_case.fill_rounds(capacity, held, peak, per_round)
    assert got == expected, f"fill_rounds({capacity}, {held}, {peak}, {per_round}): expected {expected}, got {got}"


# -- the encoder cache, read -----------------------------------------------------------------------------------------
def _outputs(items: int, seed: int = 0) -> list[torch.Tensor]:
    """A batch's encoder outputs as the model returns them: views of one tensor (576 x 1024 bf16 per item)."""
    return list(torch.zeros(items * 576, 1024, dtype=torch.bfloat16).split(576))


ITEM = 576 * 1024 * 2


def test_the_encoder_cache_is_read_in_distinct_storages():
    batch = _outputs(4)
    cache = {f"a{i}": t for i, t in enumerate(batch[:3])} | {"b": _outputs(1)[0]}
    got = run_case.encoder_cache_reading(cache)
    # 3 of a 4-item batch stay cached: its whole storage is held, plus the separate item.
    assert got == {"bytes": 5 * ITEM, "items": 4, "bytes_per_item": ITEM}, (
        f"encoder_cache_reading: expected 5 items' bytes over 4 entries, got {got}"
    )
    assert run_case.encoder_cache_reading({}) == {"bytes": 0, "items": 0, "bytes_per_item": 0}


def test_the_encoder_cache_is_found_on_v1_and_v2_runners():
    v1 = types.SimpleNamespace(encoder_cache={"x": 1})
    v2 = types.SimpleNamespace(encoder_cache=types.SimpleNamespace(encoder_outputs={"y": 2}, mm_features={}))
    got = [
        run_case.encoder_cache_entries(r)
        for r in (v1, v2, types.SimpleNamespace(encoder_cache=None), types.SimpleNamespace())
    ]
    assert got == [{"x": 1}, {"y": 2}, None, None], f"encoder_cache_entries(V1, V2, none, absent): got {got}"


def _fake_cuda(monkeypatch) -> None:
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    for name in ("memory_reserved", "memory_allocated", "max_memory_reserved", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *a, **k: [])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (10 << 30, 140 << 30))


def _fake_runner_modules(monkeypatch):
    """vLLM 0.26.0's two GPUModelRunner classes, reduced to what record_runner_memory wraps: V1's profile_run caches
    a profiled batch of 8 encoder outputs, runs its dummy forward, then clears them; V2's runs no encoder; each
    execute_model caches the encoder outputs of its step's images."""

    class V1Runner:
        def __init__(self):
            self.encoder_cache: dict = {}

        def capture_model(self):
            return 0

        def _dummy_run(self, num_tokens, **kwargs):
            return None, None

        def profile_run(self):
            for i, t in enumerate(_outputs(8)):
                self.encoder_cache[f"tmp_{i}"] = t
            self._dummy_run(16384, is_profile=True)
            self.encoder_cache.clear()

        def execute_model(self, scheduler_output, intermediate_tensors=None):
            for h in scheduler_output.free:
                self.encoder_cache.pop(h, None)
            for h, t in zip(scheduler_output.new, _outputs(len(scheduler_output.new))):
                self.encoder_cache[h] = t
            return "ran"

    class V2Runner:
        def __init__(self):
            self.encoder_cache = types.SimpleNamespace(encoder_outputs={}, mm_features={})

        def capture_model(self):
            return 0

        def _dummy_run(self, num_tokens, **kwargs):
            return None, None

        def profile_run(self):
            self._dummy_run(16384, skip_attn=True, is_profile=True)

        def execute_model(self, scheduler_output, intermediate_tensors=None):
            cache = self.encoder_cache.encoder_outputs
            for h in scheduler_output.free:
                cache.pop(h, None)
            cache.update(zip(scheduler_output.new, _outputs(len(scheduler_output.new))))
            return "ran"

    names = {
        "vllm": None,
        "vllm.v1": None,
        "vllm.v1.worker": None,
        "vllm.v1.worker.gpu": None,
        "vllm.v1.worker.gpu_model_runner": V1Runner,
        "vllm.v1.worker.gpu.model_runner": V2Runner,
    }
    modules = {}
    for name, cls in names.items():
        module = types.ModuleType(name)
        if cls is not None:
            module.GPUModelRunner = cls
        modules[name] = module
        monkeypatch.setitem(sys.modules, name, module)
    modules["vllm.v1.worker"].gpu_model_runner = modules["vllm.v1.worker.gpu_model_runner"]
    modules["vllm.v1.worker"].gpu = modules["vllm.v1.worker.gpu"]
    modules["vllm.v1.worker.gpu"].model_runner = modules["vllm.v1.worker.gpu.model_runner"]
    return V1Runner, V2Runner


@pytest.mark.parametrize("kind,profiled", [("v1", 8), ("v2", 0)])
def test_the_encoder_cache_is_recorded_at_the_profile_and_after_every_step(monkeypatch, kind, profiled):
    _fake_cuda(monkeypatch)
    record = run_case.RunnerRecord()
    v1, v2 = _fake_runner_modules(monkeypatch)
    run_case.record_runner_memory(record)
    runner = (v1 if kind == "v1" else v2)()
    runner.profile_run()
    assert "_dummy_run" not in vars(runner), "profile_run must leave no wrapper on the runner"
    step = lambda new, free=(): runner.execute_model(types.SimpleNamespace(new=list(new), free=list(free)))  # noqa: E731
    step(["warmup"])  # an engine-start step: not the case's own (recording off)
    assert record.encoder_held is None, f"{kind}: nothing recorded before the case starts, got {record.encoder_held}"
    with record.encoder_sampling():
        step([f"m{i}" for i in range(4)])
        step([f"f{i}" for i in range(8)])
        step([f"p{i}" for i in range(8)], free=["warmup", "m0", "m1", "m2"])  # m3 keeps its 4-item batch alive
        step([])
    fig = run_case.encoder_cache_figures(
        record,
        {"capacity_items": 28, "tokens_per_item": 576},
        run_case.encoder_cache_now(types.SimpleNamespace(model_runner=runner)),
        16,
    ).model_dump()
    got = (
        fig["profiled_bytes"],
        fig["profiled_items"],
        fig["held_bytes"],
        fig["items_held"],
        fig["bytes_per_item"],
        fig["items_at_peak"],
    )
    # measured 4 (one batch), fill 8, peak 8; warmup, m0, m1, m2 freed, m3 keeps its batch's storage: 20 items'
    # bytes over 17 entries
    expected = (profiled * ITEM, profiled, 20 * ITEM, 17, ITEM, 17)
    assert got == expected, (
        f"{kind} encoder cache (profiled bytes, items; held bytes, items; per item; at peak): "
        f"expected {expected}, got {got}"
    )
    step(["after"])  # after the case's phases: recording off again
    assert record.encoder_held["items"] == 17, f"{kind}: a step after the case recorded, got {record.encoder_held}"


# -- speculative decoding ------------------------------------------------------------------------------------------
class _Drafter:
    def propose(self, num_speculative_tokens, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [[] for _ in sampled_token_ids]  # the ngram drafter finding no match


class _SpecWorker:
    def __init__(self):
        self.model_runner = types.SimpleNamespace(drafter=_Drafter())
        self.init_snapshot = types.SimpleNamespace(free_memory=100 << 30)
        self.requested_memory = 90 << 30

    def execute_model(self, scheduler_output):
        return "ran"


class _SpecLLM:
    """An in-process engine for the speculative phase: prefill, then decode steps in which each request schedules
    the drafts its drafter proposed after the previous step (vLLM's V1 ngram path, synchronous)."""

    def __init__(self, seqs, state):
        self.worker = _SpecWorker()
        self.state, self.proposed = state, []
        sched = types.SimpleNamespace(max_num_batched_tokens=16384, max_num_seqs=seqs)
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(scheduler_config=sched))

    def collective_rpc(self, fn):
        return [fn(self.worker)]

    def generate(self, batch, params, use_tqdm=False):
        drafts = {i: [] for i in range(len(batch))}
        last = self.last = {i: p["prompt_token_ids"][-1] for i, p in enumerate(batch)}
        for step in range(4):
            tokens = (
                sum(len(p["prompt_token_ids"]) for p in batch)
                if step == 0
                else sum(1 + len(d) for d in drafts.values())
            )
            out = types.SimpleNamespace(
                total_num_scheduled_tokens=tokens, scheduled_spec_decode_tokens={i: d for i, d in drafts.items() if d}
            )
            self.worker.execute_model(out)
            proposed = self.worker.model_runner.drafter.propose(4, [[last[i]] for i in drafts], None, None)
            self.proposed.append(proposed)
            drafts = dict(enumerate(proposed))
        return []


def test_the_speculative_phase_proposes_k_drafts_for_every_request_and_restores_the_drafter(monkeypatch):
    state = {"allocated": 16 << 30, "reserved": 17 << 30}  # the phase's peak: +40 MiB allocated, +64 MiB reserved
    _fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: state["allocated"] + 40 * MIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: state["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a, **k: state["reserved"] + 64 * MIB)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **k: k))
    llm = _SpecLLM(8, state)
    readings = run_case.run_speculative(llm, vocab=151936, spec="ngram:4", lm_vocab=151936)
    assert llm.proposed[0] == [[llm.last[i]] * 4 for i in range(8)] and all(
        len(d) == 4 for step in llm.proposed for d in step
    ), f"speculative phase: expected 4 drafts (the last token repeated) for each of 8 requests, got {llm.proposed}"
    assert "propose" not in vars(llm.worker.model_runner.drafter), "the drafter's own propose must come back"
    assert "execute_model" not in vars(llm.worker), "the step probe must be removed after the phase"
    assert readings[0]["steps"] == [[8 * 32, 0, 0]] + [[40, 8, 32]] * 3, (
        f"steps [tokens, requests with drafts, drafts]: expected the prefill then 3 widest steps, got "
        f"{readings[0]['steps']}"
    )
    after_warmup = {"init_free": 100 << 30, "requested": 90 << 30}
    fig = parity.speculative_figures(after_warmup, readings[0])
    SpeculativeFigures.model_validate(fig)
    got = (
        fig["k"],
        fig["method"],
        fig["requests"],
        fig["rows"],
        fig["vocab"],
        fig["widest_steps"],
        fig["step_peak_allocated"],
        fig["step_reserved_growth"],
    )
    assert got == (4, "ngram", 8, 40, 151936, 3, 40 * MIB, 64 * MIB), (
        f"memory.speculative (k, method, requests, rows, vocab, widest steps, allocated, reserved growth): got {got}"
    )


def _spec_readings(free_after: int, max_reserved: int, reserved_after: int, steps=None) -> dict:
    return {
        "k": 4,
        "method": "ngram",
        "requests": 64,
        "vocab": 151936,
        "before": {"free": 11 << 30, "torch_reserved": 17 << 30, "torch_allocated": 16 << 30},
        "free_after": free_after,
        "torch_max_reserved": max_reserved,
        "torch_reserved_after": reserved_after,
        "torch_max_allocated": (16 << 30) + 195 * MIB,
        "steps": [[64 * 32, 0, 0], [320, 64, 256]] if steps is None else steps,
    }


def test_the_speculative_step_is_read_like_the_peak():
    after_warmup = {"init_free": 100 << 30, "requested": 90 << 30}
    # 10 GiB free at the end, 100 MiB of the phase's segments given back before the reading: used 90 GiB + 100 MiB.
    fig = parity.speculative_figures(
        after_warmup, _spec_readings(10 << 30, (17 << 30) + 300 * MIB, (17 << 30) + 200 * MIB)
    )
    got = (
        fig["over_budget_measured"],
        fig["reserved_released"],
        fig["step_peak_allocated"],
        fig["step_reserved_growth"],
        fig["rows"],
        fig["widest_steps"],
    )
    assert got == (100 * MIB, 100 * MIB, 195 * MIB, 300 * MIB, 320, 1), (
        f"speculative_figures (over budget, released, allocated, reserved growth, rows, widest steps): got {got}"
    )
    narrow = parity.speculative_figures(
        after_warmup, _spec_readings(10 << 30, 17 << 30, 17 << 30, steps=[[320, 64, 255], [100, 20, 80]])
    )
    assert narrow["widest_steps"] == 0, f"a step short of one draft is not the widest: got {narrow['widest_steps']}"


def _peak(free_after: int) -> dict:
    return {
        "batch": {
            "prompt_tokens": 16384,
            "max_num_batched_tokens": 16384,
            "num_seqs": 64,
            "max_num_seqs": 64,
            "step_tokens": [16384],
        },
        "before_batch": {"free": 11 << 30, "torch_reserved": 17 << 30, "torch_allocated": 16 << 30, "kv_backed": 0},
        "free_after_batch": free_after,
        "torch_max_reserved": 18 << 30,
        "torch_reserved_after": 18 << 30,
        "torch_max_allocated": 17 << 30,
        "kv_backed": 0,
    }


AFTER_WARMUP = {
    "init_free": 100 << 30,
    "requested": 90 << 30,
    "total": 140 << 30,
    "free_after_warmup": 12 << 30,
    "torch_reserved": 17 << 30,
    "kv_backed_after_warmup": 0,
}


@pytest.mark.parametrize(
    "prefill_free,spec_over,expected_over,expected_phase",
    [
        ((10 << 30) + 30 * MIB, 20 * MIB, 20 * MIB, "speculative"),  # prefill 30 MiB inside, speculative 20 MiB over
        ((10 << 30) - 40 * MIB, 20 * MIB, 40 * MIB, "prefill"),
        ((10 << 30) - 40 * MIB, None, 40 * MIB, "prefill"),  # no speculative phase
    ],
)
def test_the_case_is_over_budget_by_the_larger_of_its_two_phases(
    prefill_free, spec_over, expected_over, expected_phase
):
    spec = None if spec_over is None else {"over_budget_measured": spec_over}
    peak = parity.peak_figures(AFTER_WARMUP, _peak(prefill_free), spec)
    got = (peak["over_budget_measured"], peak["over_budget_phase"], peak["over_budget_prefill"])
    expected = (expected_over, expected_phase, (100 << 30) - prefill_free - (90 << 30))
    assert got == expected, f"peak_figures (over budget, phase, prefill's own): expected {expected}, got {got}"


def test_a_speculative_step_over_the_budget_fails_the_case_whose_prefill_peak_is_inside():
    def case(spec_over):
        spec = {"over_budget_measured": spec_over}
        memory = AFTER_WARMUP | {
            "num_gpu_blocks": 1000,
            "peak": parity.peak_figures(AFTER_WARMUP, _peak((10 << 30) + 30 * MIB), spec),
            "speculative": spec,
        }
        return {
            "memory": memory,
            "token_ids": [[1]],
            "extensible": {"measured": {"bytes_per_block": MIB, "rounding_bound": 0, "torch_growth": 0}},
        }

    legacy = case(0)
    assert parity.check_memory_budget(legacy, case(parity.BUDGET_TOLERANCE)) == []
    problems = parity.check_memory_budget(legacy, case(parity.BUDGET_TOLERANCE + 4 * MIB))
    assert len(problems) == 1 and "used 20.0 MiB more than gpu_memory_utilization allows" in problems[0], (
        f"check_memory_budget with the speculative step 20 MiB over: expected one problem naming 20.0 MiB, got "
        f"{problems}"
    )


def test_a_phase_that_never_reached_its_widest_or_full_state_is_a_problem():
    ok = {
        "memory": {
            "speculative": {"k": 4, "requests": 8, "rows": 40, "widest_steps": 3, "steps": []},
            "encoder_cache": {"capacity_items": 28, "items_at_peak": 28, "bytes_per_item": ITEM},
        }
    }
    assert parity.phase_problems(ok, "extensible") == []
    narrow = json.loads(json.dumps(ok))
    narrow["memory"]["speculative"]["widest_steps"] = 0
    half = json.loads(json.dumps(ok))
    half["memory"]["encoder_cache"]["items_at_peak"] = 20
    got = parity.phase_problems(narrow, "legacy") + parity.phase_problems(half, "extensible")
    assert (
        len(got) == 2
        and got[0].startswith(
            "legacy speculative phase never ran its widest step: expected 8 requests x 4 drafts (40 rows)"
        )
        and got[1].startswith("extensible encoder cache held 20 items at the measured peak, expected it full (28")
    ), f"phase_problems of a narrow speculative phase and a half-full encoder cache: got {got}"
    assert parity.phase_problems({"memory": None}, "legacy") == [] and parity.phase_problems({}, "legacy") == []


# -- run(), end to end on a fake engine -----------------------------------------------------------------------------
def _fake_engine(monkeypatch, image_tokens: int = 576) -> dict:
    """run()'s vLLM, in-process: ``LLM(**kwargs)`` builds one worker whose runner is the fake V1 runner class
    (wrapped by ``record_runner_memory``) and runs vLLM's profile; ``generate`` runs all its prompts in one step
    through the worker (an image already cached is not encoded again, as vLLM hashes it), then, with speculation
    and more than one token, three decode steps with the drafts the drafter proposed. Free memory: 50 MiB over the
    budget at the speculative phase's end, 20 MiB inside it at the peak batch's."""
    import hashlib

    v1, _ = _fake_runner_modules(monkeypatch)
    _fake_cuda(monkeypatch)
    state = {"free": 10 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (state["free"], 140 << 30))
    monkeypatch.setattr(run_case, "refused_import", lambda config, model: None)
    monkeypatch.setattr(run_case.os, "environ", dict(run_case.os.environ))
    log: dict = {"generates": [], "images": []}
    record_runner_memory = run_case.record_runner_memory

    def recorded(record):  # the run's RunnerRecord, kept for the test to read
        log["record"] = record
        record_runner_memory(record)

    monkeypatch.setattr(run_case, "record_runner_memory", recorded)

    class Worker:
        def __init__(self, runner):
            self.model_runner = runner
            self.init_snapshot = types.SimpleNamespace(free_memory=100 << 30)
            self.requested_memory = 90 << 30
            self.cache_config = types.SimpleNamespace(num_gpu_blocks=1000)

        def execute_model(self, scheduler_output):
            return self.model_runner.execute_model(scheduler_output)

    class LLM:
        def __init__(self, **kwargs):
            log["kwargs"] = kwargs
            runner = v1()
            runner.model_memory_usage = 1 << 30
            runner.supports_mm_inputs = "limit_mm_per_prompt" in kwargs
            runner.mm_budget = types.SimpleNamespace(
                encoder_cache_size=16384,
                mm_max_toks_per_item={"image": 576},
                mm_max_items_per_batch={"image": 8},
                get_modality_with_max_tokens=lambda: "image",
                get_encoder_budget=lambda: 16384,
            )
            self.k = (kwargs.get("speculative_config") or {}).get("num_speculative_tokens", 0)
            if self.k:
                runner.drafter = _Drafter()
            if runner.supports_mm_inputs:
                runner.profile_run()  # vLLM's profile, during the engine's start (V1: one batch of 8 images)
            self.worker = Worker(runner)
            sched = types.SimpleNamespace(
                max_num_batched_tokens=kwargs["max_num_batched_tokens"], max_num_seqs=kwargs["max_num_seqs"]
            )
            self.llm_engine = types.SimpleNamespace(
                vllm_config=types.SimpleNamespace(
                    scheduler_config=sched, model_config=types.SimpleNamespace(max_model_len=kwargs["max_model_len"])
                )
            )

        def collective_rpc(self, fn):
            return [fn(self.worker)]

        def apply_model(self, fn):
            return [0]

        def generate(self, batch, params, use_tqdm=False):
            log["generates"].append((len(batch), params["max_tokens"]))
            new, lengths = [], []
            for p in batch:
                ids = p["prompt_token_ids"]
                if "multi_modal_data" in p:
                    digest = hashlib.sha1(p["multi_modal_data"]["image"].tobytes()).hexdigest()
                    log["images"].append(digest)
                    if digest not in self.worker.model_runner.encoder_cache and digest not in new:
                        new.append(digest)
                    assert ids.count(1022) == 1
                    lengths.append(len(ids) - 1 + image_tokens)  # vLLM's processor expands the image_pad
                else:
                    lengths.append(len(ids))
            step = lambda tokens, drafts={}: self.worker.execute_model(  # noqa: E731
                types.SimpleNamespace(
                    total_num_scheduled_tokens=tokens,
                    new=new if not drafts else [],
                    free=[],
                    scheduled_spec_decode_tokens=drafts,
                )
            )
            step(sum(lengths))
            if self.k and params["max_tokens"] > 1:
                for _ in range(3):
                    drafts = dict(
                        enumerate(
                            self.worker.model_runner.drafter.propose(
                                self.k, [[ids["prompt_token_ids"][-1]] for ids in batch], None, None
                            )
                        )
                    )
                    step(sum(1 + len(d) for d in drafts.values()), drafts)
            if params["max_tokens"] == run_case.SPECULATIVE_MAX_TOKENS:
                state["free"] = (10 << 30) - 50 * MIB
            if sum(lengths) == self.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens:
                state["free"] = (10 << 30) + 20 * MIB
            return [
                types.SimpleNamespace(
                    outputs=[types.SimpleNamespace(token_ids=[7] * params["max_tokens"])],
                    num_cached_tokens=32,
                    prompt_token_ids=[0] * n,
                )
                for n in lengths
            ]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **k: k))
    return log


def _run(*argv: str) -> dict:
    args = run_case.parser().parse_args(
        [*argv, "--mode", "legacy", "--max-model-len", "4096", "--no-sensitivity", "--out", "x"]
    )
    result = run_case.run(args)
    IntegrationCase.model_validate_json(json.dumps(result))  # the case file's schema
    return result


def test_a_speculative_case_measures_its_widest_step_before_the_peak_batch(monkeypatch):
    log = _fake_engine(monkeypatch)
    result = _run("--model", "qwen3-0.6b-shape", "--runner", "v1", "--speculative", "ngram:4")
    assert log["kwargs"]["speculative_config"] == SPEC_CONFIG, log["kwargs"]
    assert log["generates"] == [(4, 1), (4, 24), (8, run_case.SPECULATIVE_MAX_TOKENS), (8, 1)], (
        f"run() with ngram:4: expected warm pass, measured pass, speculative phase, peak batch, got {log['generates']}"
    )
    memory = result["memory"]
    spec, peak = memory["speculative"], memory["peak"]
    got = (spec["k"], spec["requests"], spec["rows"], spec["vocab"], spec["widest_steps"], spec["over_budget_measured"])
    assert got == (4, 8, 40, 151936, 3, 50 * MIB), (
        f"memory.speculative (k, requests, rows, vocab, widest steps, over budget): got {got}"
    )
    got = (peak["over_budget_measured"], peak["over_budget_phase"], peak["over_budget_prefill"], peak["peak_shaped"])
    assert got == (50 * MIB, "speculative", -20 * MIB, True), (
        f"memory.peak (over budget, phase, prefill's, peak-shaped): expected the speculative step's 50 MiB, got {got}"
    )
    assert result["ranks"]["speculative"] == [spec] and result["ranks"]["peak"][0]["over_budget_phase"] == "speculative"
    assert "encoder_cache" not in memory and log["record"].encoder_held == {"bytes": 0, "items": 0, "bytes_per_item": 0}


def test_a_multimodal_case_fills_the_encoder_cache_then_runs_a_peak_batch_of_images(monkeypatch):
    log = _fake_engine(monkeypatch)
    result = _run("--model", "tiny-mm", "--runner", "v1")
    assert log["generates"] == [(4, 1), (4, 24), (8, 1), (8, 1), (8, 1)], (
        f"run() on tiny-mm: expected warm pass, measured pass, two fill rounds of 8, peak batch, got {log['generates']}"
    )
    images = log["images"]
    assert len(images) == 4 + 4 + 16 + 8 and images[:4] == images[4:8] and len(set(images)) == 28, (
        f"images: expected the measured pass's 4 twice, then 24 distinct others, got {len(set(images))} distinct "
        f"of {len(images)}"
    )
    enc, peak = result["memory"]["encoder_cache"], result["memory"]["peak"]
    got = (
        enc["profiled_bytes"],
        enc["profiled_items"],
        enc["held_bytes"],
        enc["items_held"],
        enc["bytes_per_item"],
        enc["items_at_peak"],
        enc["capacity_items"],
        enc["fill_requests"],
    )
    expected = (8 * ITEM, 8, 28 * ITEM, 28, ITEM, 28, 28, 16)
    assert got == expected, (
        f"memory.encoder_cache (profiled bytes, items; held bytes, items; per item; at peak; "
        f"capacity; fill requests): expected {expected}, got {got}"
    )
    got = (peak["batch"]["prompt_tokens"], peak["peak_shaped"], peak["over_budget_phase"])
    assert got == (16384, True, "prefill"), (
        f"peak batch of images: expected 16384 tokens once expanded, peak-shaped, got {peak['batch']}"
    )
    assert result["prompt_lens"] == [40 + 2 + 576] * 4, result["prompt_lens"]
    assert (log["kwargs"]["limit_mm_per_prompt"], log["kwargs"]["skip_tokenizer_init"]) == (
        {"image": 1, "video": 0},
        False,
    )


def test_the_peak_batch_counts_the_prompt_tokens_vllm_reports(monkeypatch):
    _fake_engine(monkeypatch, image_tokens=577)  # vLLM expanding an image to one token more than its budget said
    peak = _run("--model", "tiny-mm", "--runner", "v1")["memory"]["peak"]
    got = (peak["batch"]["prompt_tokens"], peak["peak_shaped"])
    assert got == (16384 + 8, False), (
        f"peak batch when vLLM reports 577 tokens per image: expected (16392, not peak-shaped), got {got}"
    )


# -- vLLM's refusal of ngram on V2 ---------------------------------------------------------------------------------
def _vllm_refusing_v2_ngram():
    """vLLM 0.26.0's VllmConfig validation as it refuses: a pydantic dataclass whose __post_init__ raises
    ValueError, which pydantic turns into a ValidationError (a ValueError)."""
    import pydantic

    @pydantic.dataclasses.dataclass
    class VllmConfig:
        speculative: dict

        def __post_init__(self):
            raise ValueError(V2_NGRAM)

    def llm(**kwargs):
        VllmConfig(speculative=kwargs["speculative_config"])

    return types.SimpleNamespace(LLM=llm, SamplingParams=lambda **k: k)


def test_v2_refusing_ngram_is_written_as_refused_and_listed_as_a_refused_combination(monkeypatch, tmp_path):
    _fake_runner_modules(monkeypatch)
    monkeypatch.setitem(sys.modules, "vllm", _vllm_refusing_v2_ngram())
    monkeypatch.setattr(run_case.os, "environ", dict(run_case.os.environ))  # _env writes the engine's variables
    case = next(c for c in matrix.CASES if c.id == "qwen3-0.6b-shape-v2-FLASH_ATTN-bf16-b16-ngram4")
    args = run_case.parser().parse_args(case.args("legacy") + ["--out", str(tmp_path / "x.json")])
    result = run_case.run(args)
    assert run_case.os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1", (
        f"run_case --runner v2: expected VLLM_USE_V2_MODEL_RUNNER=1, got "
        f"{run_case.os.environ['VLLM_USE_V2_MODEL_RUNNER']}"
    )
    assert (
        result["refused"].startswith("ValidationError: ")
        and V2_NGRAM in result["refused"]
        and result["refused_by"] == "vllm"
    ), f"run_case on V2 with ngram: expected vLLM's refusal, got {result}"
    run = json.loads(IntegrationCase.model_validate_json(json.dumps(result)).model_dump_json(by_alias=True))
    calls = []

    def runner(name, run_args, timeout, cut):
        calls.append(name)
        return run

    runs = parity.run_parity(case, runner)
    verdict = classify_with_fallback(runs)
    assert (calls, verdict.outcome) == ([f"{case.id}-legacy"], REFUSED) and V2_NGRAM in verdict.detail, (
        f"run_parity of a refused combination: expected one legacy run, outcome refused, got {calls}, {verdict}"
    )
    out = tmp_path / "integration"
    out.mkdir()
    (out / f"{case.id}-legacy.json").write_text(json.dumps(run))
    rows, _ = matrix.rows_from_files(matrix.CASES, out)
    row = next(r for r in rows if r["case"] == case.id)
    assert row["outcome"] == REFUSED and f"- {case.id}: ValidationError" in parity.table([row]), (
        f"matrix row of the refused case: expected outcome refused with vLLM's reason, got {row}"
    )


def test_a_multimodal_case_fails_naming_an_import_it_misses(monkeypatch):
    import importlib

    real = importlib.import_module

    def without_torchvision(name, *a, **k):
        if name == "torchvision":
            raise ModuleNotFoundError("No module named 'torchvision'")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", without_torchvision)
    got = run_case.refused_import(MM, "tiny-mm")
    assert got == (
        "refused: tiny-mm needs torchvision (vLLM's Qwen2-VL image processor imports it): "
        "ModuleNotFoundError: No module named 'torchvision'"
    ), f"refused_import without torchvision: {got}"
    assert run_case.refused_import(run_case.model_config("qwen3-0.6b-shape"), "qwen3-0.6b-shape") is None
    monkeypatch.setattr(run_case.os, "environ", dict(run_case.os.environ))
    args = run_case.parser().parse_args(["--model", "tiny-mm", "--runner", "v1", "--mode", "legacy", "--out", "x"])
    with pytest.raises(SystemExit, match="refused: tiny-mm needs torchvision"):
        run_case.run(args)  # before vLLM is imported: this machine has none


# -- the matrix ----------------------------------------------------------------------------------------------------
MM_IDS = ["tiny-mm-v1-FLASH_ATTN-bf16-b16", "tiny-mm-v2-FLASH_ATTN-bf16-b16"]
SPEC_IDS = [
    "qwen3-0.6b-shape-v1-FLASH_ATTN-bf16-b16-ngram4",
    "qwen3-0.6b-shape-v2-FLASH_ATTN-bf16-b16-ngram4",
    "qwen3-0.6b-shape-v1-FLASH_ATTN-bf16-b16-ngram4-s64",
]


def test_the_matrix_lists_the_multimodal_and_speculative_cases():
    proc = _python("-m", "integration.matrix", "unused", "--only", "mm", "spec", "--list")
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[:2] for line in proc.stdout.splitlines()[:-1]]
    expected = [[i, "mm"] for i in MM_IDS] + [[i, "spec"] for i in SPEC_IDS]
    assert listed == expected, f"matrix --only mm spec --list: expected {expected}, got {listed}"
    assert proc.stdout.splitlines()[-1].startswith("5 cases, ~"), proc.stdout
    everything = _python("-m", "integration.matrix", "unused", "--list").stdout
    assert all(i in everything for i in MM_IDS + SPEC_IDS), f"matrix --list must show the new cases: {everything}"


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_the_new_cases_run_with_their_settings():
    by_id = {c.id: c for c in matrix.CASES}
    missing = [cid for cid in MM_IDS + SPEC_IDS if cid not in by_id]
    assert not missing, f"matrix.CASES: expected the cases {missing}, got ids {sorted(by_id)}"
    for cid in MM_IDS:
        c = by_id[cid]
        assert (c.model, c.backend, c.kv_cache_dtype, c.block_size, c.speculative) == (
            "tiny-mm",
            "FLASH_ATTN",
            "auto",
            16,
            None,
        ), f"{cid}: got {c}"
    for cid in SPEC_IDS:
        args = by_id[cid].args("extensible")
        got = tuple(
            _flag(args, f) for f in ("--speculative", "--max-num-seqs", "--backend", "--block-size", "--kv-cache-dtype")
        )
        seqs = "64" if cid.endswith("-s64") else "8"
        assert got == ("ngram:4", seqs, "FLASH_ATTN", "16", "auto"), (
            f"{cid} run_case args (speculative, seqs, backend, block, KV dtype): expected ngram:4, {seqs}, "
            f"FLASH_ATTN, 16, auto; got {got}"
        )
    assert Case("m", "v1", speculative="ngram:4", max_num_seqs=64, variant="s64").label == "m (ngram:4, 64 seqs)"


def test_the_table_names_speculation_and_notes_both_phases():
    spec = {
        "k": 4,
        "method": "ngram",
        "requests": 64,
        "rows": 320,
        "vocab": 151936,
        "widest_steps": 12,
        "step_peak_allocated": 195 * MIB,
        "step_reserved_growth": 200 * MIB,
        "over_budget_measured": -3 * MIB,
    }
    enc = {
        "held_bytes": 28 * ITEM,
        "items_held": 28,
        "bytes_per_item": ITEM,
        "items_at_peak": 28,
        "capacity_items": 28,
        "profiled_bytes": 8 * ITEM,
    }
    case = Case("qwen3-0.6b-shape", "v1", speculative="ngram:4", max_num_seqs=64, variant="s64")
    runs = {
        "legacy": [{"token_ids": [[1]], "memory": {"num_gpu_blocks": 9, "speculative": spec, "encoder_cache": enc}}]
        * 2,
        "extensible": None,
    }
    r = parity.row(case, runs)
    text = parity.table([r])
    assert "| qwen3-0.6b-shape (ngram:4, 64 seqs) | v1 |" in text, text
    assert (
        "widest speculative step (ngram, 64 requests x (1 + 4) = 320 rows x 151936 vocab, 12 such steps): "
        "torch allocated +195.0 MiB, reserved +200.0 MiB, -3.0 MiB over budget at its end" in text
    ), text
    assert (
        "encoder cache: 31.5 MiB held at most (28 items of 1.12 MiB; 28 of 28 at the measured peak), 9.0 MiB "
        "during vLLM's profile" in text
    ), text
