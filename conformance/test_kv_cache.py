"""Rules of ExtensibleKVCacheBuffers on a driver: block prefixes, layouts, Mamba and hybrid, rollback, accounting."""

from __future__ import annotations

import pytest
import torch

from extensible_kv.errors import CommitError, InvalidSizeError
from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer
from extensible_kv.layout import LayoutError

from . import layouts
from .helpers import expect, expect_bytes, expect_equal
from .layouts import MAX_BLOCKS


def _mapped_granules(driver, cache, buffer: str) -> set[int]:
    t = cache.tensor(buffer)
    g = driver.granularity()
    base = t.base_address
    out = set()
    for va, size in driver.outstanding().mappings.items():
        if base <= va < base + t.stats().reserved_bytes:
            out |= set(range((va - base) // g, (va - base + size) // g))
    return out


@pytest.mark.parametrize("layout", layouts.LAYOUTS, ids=list(layouts.LAYOUTS))
def test_ensure_blocks_maps_the_granules_of_the_block_prefix_and_no_more(driver, layout):
    cache = layouts.kv_cache(driver, layout)
    _, want_segments = layouts.LAYOUTS[layout]
    g = driver.granularity()
    for n in (1, 37, MAX_BLOCKS // 2 + 3, MAX_BLOCKS):
        cache.ensure_blocks(n)
        for b in cache.buffers:
            segs = cache.tensor(b.name).num_segments
            expect_equal(driver, f"{layout}: segments of buffer {b.name}", want_segments, segs)
            ranges = []
            for layer in b.layers:
                for view, dim in zip(cache.layer_views(layer.name), layer.block_dims()):
                    ranges += layouts.footprint(view, dim, n)
            # Every byte the blocks' views reach must be backed; beyond them, at most one page of padding per range.
            used = layouts.merge(ranges)
            need = layouts.granules_of(used, g)
            allowed = layouts.granules_of([(lo, hi + b.page_size_bytes) for lo, hi in used], g)
            got = _mapped_granules(driver, cache, b.name)
            expect(
                need <= got <= allowed,
                driver,
                f"{layout}: granules mapped for {n} blocks in buffer {b.name}",
                f"{len(need)} to {len(allowed)} granules from {sorted(need)[:4]}...",
                f"{len(got)} granules {sorted(got)[:4]}...",
                missing=sorted(need - got)[:6],
                extra=sorted(got - allowed)[:6],
            )
    cache.close()


@pytest.mark.parametrize("layout", layouts.LAYOUTS, ids=list(layouts.LAYOUTS))
def test_committed_blocks_written_through_layer_views_survive_growth(driver, layout):
    # Layers sharing a buffer share its block pool, as in vLLM: layer j of a buffer owns blocks b with b % L == j.
    cache = layouts.kv_cache(driver, layout)
    old_n = 40
    cache.ensure_blocks(old_n)
    written = []
    for b in cache.buffers:
        for j, layer in enumerate(b.layers):
            own = torch.arange(j, old_n, len(b.layers))
            for k, (view, dim) in enumerate(zip(cache.committed_layer_views(layer.name), layer.block_dims())):
                shape = list(view.shape)
                shape[dim] = len(own)
                data = torch.randn(shape, generator=torch.Generator().manual_seed(k)).to(view.dtype)
                view.index_copy_(dim, own.to(view.device), data.to(view.device))
                written.append((layer.name, k, dim, own, data, cache.layer_views(layer.name)[k].data_ptr()))
    cache.ensure_blocks(MAX_BLOCKS)
    driver.synchronize()
    for name, k, dim, own, data, ptr in written:
        view = cache.committed_layer_views(name)[k]
        kept = view.index_select(dim, own.to(view.device))
        expect_bytes(
            driver,
            f"{layout}: layer {name} state {k} blocks {own.tolist()[:3]}... after growth {old_n}->{MAX_BLOCKS}",
            kept.contiguous().view(torch.uint8),
            data.contiguous().view(torch.uint8),
        )
        new = view.narrow(dim, old_n, MAX_BLOCKS - old_n)
        expect(
            int(new.count_nonzero()) == 0,
            driver,
            f"{layout}: layer {name} state {k} new blocks",
            "zero",
            f"{int(new.count_nonzero())} nonzero elements",
        )
        now = cache.layer_views(name)[k].data_ptr()
        expect_equal(driver, f"{layout}: layer {name} full view address after growth", ptr, now)
    del view, kept, new
    cache.close()


def test_ensure_blocks_is_idempotent_and_grow_only(driver):
    cache = layouts.kv_cache(driver, "kv_first")
    expect_equal(
        driver,
        "ensure_blocks(50) (its return value, num_blocks)",
        (50, 50),
        (cache.ensure_blocks(50), cache.num_blocks),
    )
    before = len(driver.calls)
    for n in (10, 50, 0):
        got = cache.ensure_blocks(n)
        expect_equal(driver, f"ensure_blocks({n}) after 50", 50, got)
    expect_equal(driver, "driver calls of no-op ensure_blocks", [], driver.calls[before:])
    for bad in (MAX_BLOCKS + 1, -1, 2.0, "3"):
        with pytest.raises(InvalidSizeError):
            cache.ensure_blocks(bad)
    expect_equal(driver, "num_blocks after invalid ensure_blocks", 50, cache.num_blocks)
    cache.close()


def test_legacy_mode_commits_every_block_at_construction(driver):
    cache = layouts.kv_cache(driver, "kv_first", legacy=True)
    expect_equal(driver, "num_blocks in legacy mode", MAX_BLOCKS, cache.num_blocks)
    stats = cache.stats()
    expect_equal(driver, "committed bytes in legacy mode", 2 * MAX_BLOCKS * layouts.PAGE, stats.committed_bytes)
    cache.close()


@pytest.mark.parametrize("op", ["create", "map", "set_access", "zero"])
def test_failed_ensure_blocks_keeps_every_buffer_at_the_old_block_count(driver, op):
    cache = layouts.kv_cache(driver, "kv_first", buffers=3)
    cache.ensure_blocks(20)
    before = driver.outstanding().mappings
    driver.fail(op, 3)  # the third call of the step: inside the second buffer
    with pytest.raises(CommitError):
        cache.ensure_blocks(MAX_BLOCKS)
    expect_equal(driver, f"num_blocks after a failed {op}", 20, cache.num_blocks)
    expect_equal(driver, f"mappings after a failed {op}", before, driver.outstanding().mappings)
    sizes = [cache.tensor(b.name).bytes_per_segment for b in cache.buffers]
    expect_equal(driver, f"bytes per segment of every buffer after a failed {op}", [20 * layouts.PAGE // 2] * 3, sizes)
    expect_equal(
        driver,
        "ensure_blocks after the failure (its return value, num_blocks)",
        (MAX_BLOCKS, MAX_BLOCKS),
        (cache.ensure_blocks(MAX_BLOCKS), cache.num_blocks),
    )
    cache.close()


def test_layers_sharing_a_buffer_must_agree_on_segments(driver):
    bad = KVBuffer("b0", layouts.PAGE, (layouts.flash_nhd("a"), layouts.kv_first("b")))
    with pytest.raises(LayoutError, match="disagree"):
        ExtensibleKVCacheBuffers([bad], MAX_BLOCKS, driver=driver)
    expect_equal(driver, "driver calls for a rejected layout", [], driver.calls)


def test_stats_account_reserved_committed_backed_and_waste(driver):
    cache = layouts.kv_cache(driver, "kv_first", buffers=2)
    cache.ensure_blocks(33)
    g = driver.granularity()
    stats = cache.stats()
    for row in stats.buffers:
        backed = len(_mapped_granules(driver, cache, row.name)) * g
        want = {
            "committed_bytes": 33 * layouts.PAGE,
            "reserved_bytes": -(-MAX_BLOCKS * layouts.PAGE // g) * g,
            "backed_bytes": backed,
            "waste_bytes": backed - 33 * layouts.PAGE,
            "num_segments": 2,
        }
        got = {k: getattr(row, k) for k in want}
        expect_equal(driver, f"stats of buffer {row.name}", want, got)
    expect_equal(driver, "total stats", (33, 2 * 33 * layouts.PAGE), (stats.num_blocks, stats.committed_bytes))
    cache.close()
