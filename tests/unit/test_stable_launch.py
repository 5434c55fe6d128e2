"""Stable decode launches (CompressedLayer.stable_launch): a packed store allocated for one token
capacity and read whole with its live count on the device, and a layer whose static step reads
pend_start from the device, so a CUDA graph of the step outlives flushes. CPU: the store's
capacity rule and counts, the virtual visibility, and the layer-graph period across flushes (the
kernel itself runs in tests/kernels/test_layer_graphs.py)."""

from __future__ import annotations

import torch

import kvcalib.runtime.cache as cache_mod
from kvcalib.layout import LayerConfig
from kvcalib.runtime.cache import CompressedLayer
from kvcalib.runtime.layer_graphs import LayerGraphs
from kvcalib.runtime.static import StaticState
from kvcalib.runtime.store import GROWTH, MIN_SLACK_BLOCKS

CFG = LayerConfig(k_bits=2, v_bits=4, k_group=8, v_group=16, window=8, sinks=2)  # flush block 8
B, H, D = 2, 2, 32


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)  # (B, H, n, D) x 2


def _dynamic(layer: CompressedLayer, n: int, seed: int) -> None:
    """``n`` tokens through the dynamic path, as a model's step would put them (update, commit, flush)."""
    k, v = _tokens(n, seed)
    layer.update(k, v)
    layer.commit()
    layer.flush()


def test_a_store_keeps_one_token_capacity_and_its_count_on_the_device():
    layer = CompressedLayer(CFG)
    _dynamic(layer, 202, 0)  # 2 sinks, 192 packed, 8 pending
    store = layer.packed.stores[0]
    assert store.n == 192
    view = store.capacity_view()
    cap = view.n
    assert cap == store.capacity_for(192) and cap % CFG.flush_block == 0
    assert 192 + max(192 * GROWTH, MIN_SLACK_BLOCKS * 8) <= cap < 192 + max(192 * GROWTH, MIN_SLACK_BLOCKS * 8) + 8
    assert view.k_codes.shape[2] == view.v_codes.shape[2] == view.v_scale.shape[2] == cap
    assert view.k_scale.shape[2] == cap // CFG.k_group  # per-channel key scales: one row per key group
    assert torch.equal(store.device_range()[1], torch.full((B,), 192, dtype=torch.int32))
    generation = store.generation
    steps = 0
    while store.n + CFG.flush_block <= cap:  # flushes that fit: the same allocation, the count moves
        _dynamic(layer, 1, 100 + steps)
        steps += 1
        assert store.capacity_view() is view and store.generation == generation
        assert int(store.device_range()[1][0]) == store.n
    assert store.n == cap and steps > 0
    for i in range(CFG.flush_block):  # the next flush reallocates: a new view, a new generation
        _dynamic(layer, 1, 1000 + i)
    assert store.generation != generation and store.capacity_view() is not view
    assert store.capacity_view().n == store.capacity_for(cap + CFG.flush_block)
    live = store.view()
    whole = store.capacity_view()
    assert torch.equal(whole.k_codes[:, :, :store.n], live.k_codes) and torch.equal(whole.v_zero[:, :, :store.n],
                                                                                   live.v_zero)


def test_which_layers_launch_stably(monkeypatch):
    layer = CompressedLayer(CFG)
    _dynamic(layer, 40, 0)
    assert layer.stable_launch
    sliding = CompressedLayer(CFG, sliding_window=16)
    _dynamic(sliding, 40, 0)
    assert not sliding.stable_launch  # drops packed blocks: its store's front moves
    sixteen = CompressedLayer(LayerConfig(k_bits=16, v_bits=16, window=8))
    _dynamic(sixteen, 40, 0)
    assert not sixteen.stable_launch
    monkeypatch.setattr(cache_mod, "STABLE_LAUNCH_MAX_WORK", B * H * layer.packed.n - 1)
    assert not layer.stable_launch  # past the work bound the kernel's exact launch is the faster


def test_the_virtual_visibility_is_the_sinks_then_the_pending_tokens():
    layer = CompressedLayer(CFG)
    _dynamic(layer, 29, 0)  # 2 sinks, 16 packed, 11 pending
    mask, mask_packed = layer.decode_visibility()  # (1, S + window + block)
    assert not mask_packed and mask.shape == (1, 2 + CFG.window + CFG.flush_block)
    assert mask[0].tolist() == [True] * (2 + 11) + [False] * (CFG.window + CFG.flush_block - 11)


def test_a_static_layer_keeps_its_period_across_flushes_that_fit():
    """Static steps of a stable layer: the slot and mask come from pend_start on the device, a
    flush rewrites it and the store's count, and the layer-graph period (what a captured graph
    baked in) stays the same until the store is reallocated. The pending window and stored codes
    equal a twin layer fed the same tokens dynamically."""
    static, twin = CompressedLayer(CFG), CompressedLayer(CFG)
    _dynamic(static, 202, 0)
    _dynamic(twin, 202, 0)
    position = torch.tensor([static.n_seen])  # (1,)
    static.make_static(StaticState.create(position, static.static_length() + 64))
    assert static.static_mask is not None
    graphs = LayerGraphs("eager")
    query = torch.zeros(B, H, 1, D)
    period = graphs._period(static, query)
    store = static.packed.stores[0]
    flushes = 0
    for i in range(3 * CFG.flush_block):
        k, v = _tokens(1, 500 + i)
        position.fill_(static.n_seen)
        static._update_static(k, v)
        assert int(static.static_slot) == static.n_seen - static.pend_start
        assert static.static_mask[0].sum() == 2 + static.pend_k.shape[-2] + 1  # sinks, pending, this token
        static.advance_static()
        if static.flush_due():
            static.flush()
            flushes += 1
            assert int(static.pend_start_dev) == static.pend_start
            assert int(store.device_range()[1][0]) == store.n
        twin.update(k, v)
        twin.commit()
        twin.flush()
        assert torch.equal(static.pend_k, twin.pend_k) and static.pend_start == twin.pend_start
    assert flushes == 3 and store.n == 192 + 3 * CFG.flush_block
    assert graphs._period(static, query) == period  # one graph would have served all of it
    assert torch.equal(store.view().k_codes, twin.packed.stores[0].view().k_codes)


def test_rows_split_from_a_dense_layer_keep_the_capacity_rule():
    """A dense layer that meets padding after holding tokens (a chat's next turn, padded) copies
    its rows into one layer each: their stores follow the capacity rule, so they launch stably."""
    layer = CompressedLayer(CFG)
    _dynamic(layer, 120, 0)
    held = layer.packed.n  # packed when the rows are split off
    k, v = _tokens(4, 9)
    layer.update(k, v)
    layer.commit(torch.tensor([[True] * 4, [True, True, False, False]]))  # row 1 right-padded: ragged now
    layer.flush()
    assert layer.rows is not None and layer.n_packed > 0
    for row in layer.rows:
        store = row.packed.stores[0]
        whole = store.capacity_view()
        assert whole is not None and whole.n == store.capacity_for(held) and store.n > held
        assert row.stable_launch and not layer.stable_launch
        assert torch.equal(whole.k_codes[:, :, :store.n], store.view().k_codes)
