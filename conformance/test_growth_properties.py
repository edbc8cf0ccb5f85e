"""Random grow / fault / write / read sequences, checked against a model: one bytearray per segment."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from extensible_kv.errors import CommitError

from .helpers import expect, expect_equal, expected_granules, granule_states
from .tensors import new_tensor


@st.composite
def plans(draw):
    num_segments = draw(st.integers(1, 4), label="num_segments")
    quarter_granules = draw(st.integers(1, 12), label="segment size in quarter granules")
    extra = draw(st.integers(0, 3), label="extra 256-byte units per segment")
    faults = st.one_of(
        st.none(), st.tuples(st.sampled_from(["create", "map", "release", "set_access", "zero"]), st.integers(1, 3))
    )
    steps = draw(
        st.lists(st.tuples(st.floats(0.0, 1.0), st.booleans(), st.integers(0, 2**16), faults), min_size=1, max_size=6),
        label="steps (fraction, zero_new, seed, injected fault)",
    )
    return num_segments, quarter_granules, extra, steps


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None)
@given(plan=plans())
def test_random_growth_matches_a_bytearray_model(driver, plan):
    num_segments, quarter_granules, extra, steps = plan
    g = driver.granularity()
    seg = quarter_granules * g // 4 // 256 * 256 + extra * 256 or 256
    t = new_tensor(seg * num_segments, num_segments, driver=driver, alignment=256)
    model = [bytearray(seg) for _ in range(num_segments)]
    known = 0  # bytes per segment whose value the model knows
    try:
        for fraction, zero_new, seed, fault in steps:
            target = max(t.bytes_per_segment, int(fraction * seg) // 256 * 256, 256)
            note(f"grow {t.bytes_per_segment} -> {target} per segment (zero_new={zero_new}, fault={fault})")
            old = t.bytes_per_segment
            if fault:
                driver.fail(*fault)
            try:
                t.resize_per_segment_(target, zero_new=zero_new)
            except CommitError:
                target = old  # the step rolled back: the model does not move
            finally:
                driver.clear_faults()
            expect_equal(driver, "size after the step", target, t.bytes_per_segment)
            if zero_new:
                for m in model:
                    m[old:target] = bytes(target - old)
                if known == old:
                    known = target
            # Write a random window of every segment, then make everything committed known by writing the rest.
            gen = torch.Generator().manual_seed(seed)
            for i, m in enumerate(model):
                data = torch.randint(0, 256, (target - known,), generator=gen, dtype=torch.uint8)
                t.segment_view(i)[known:target].copy_(data.to(t.device))
                m[known:target] = bytes(data.tolist())
            known = target
            driver.synchronize()
            for i, m in enumerate(model):
                actual = bytes(t.segment_view(i).cpu().tolist())
                expect(
                    actual == bytes(m[:target]),
                    driver,
                    f"segment {i} after growth to {target}",
                    "the model's bytes",
                    f"{sum(a != b for a, b in zip(actual, m))} bytes differ",
                )
            states = granule_states(driver, t.base_address, t.max_num_bytes)
            expect_equal(driver, f"accessible granules after growth to {target}", expected_granules(t), states)
    finally:
        t.close(force=True)
