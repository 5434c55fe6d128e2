"""A padded batch's rows joined in shared allocations, one kernel launch per layer and step
(``kvcalib/runtime/joint.py``): the same attention as the rows launched one by one, in dynamic
and static mode, across flushes and a row outgrowing the shared allocation.

On CPU the kernel runs under Triton's interpreter; on CUDA (device tool) compiled, and the static
steps captured in per-layer graphs that outlive the rows' flushes.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import kernel_modules

DEVICE, INTERPRET, _ = kernel_modules("kvcalib_kernels.decode_attention")  # before any kernel import

import kvcalib.runtime.joint as joint_module  # noqa: E402
import kvcalib.runtime.store as store_module  # noqa: E402
from kvcalib.recipe import LayerConfig, Recipe  # noqa: E402
from kvcalib.runtime.cache import CompressedCache  # noqa: E402
from kvcalib.runtime.graphs import GraphDecoder  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.kernels.test_graph_decode import _dynamic_logits  # noqa: E402
from tests.kernels.test_graph_padding import _batch  # noqa: E402


def _recipe() -> Recipe:
    """Sinks 4, groups 16, window 16: K2V4 (per-head clip) and K3V3 (Hadamard-rotated):
    layouts that join (global, untiered, no OTT pool)."""
    l0 = LayerConfig(k_bits=2, v_bits=4, k_group=16, v_group=16, window=16, sinks=4)
    l1 = LayerConfig(k_bits=3, v_bits=3, k_group=16, v_group=16, window=16, sinks=4)
    tensors = {f"layers.0.{s}.clip": torch.tensor([[0.85], [0.7]]) for s in "kv"}
    tensors["layers.1.k.rotate"] = torch.tensor([7, 2, 64])  # (seed, kv heads, head_dim)
    tensors["layers.1.v.rotate"] = torch.tensor([8, 2, 64])
    return Recipe(name="joinable", layers=[l0, l1], tensors=tensors)


@pytest.mark.slow
def test_joined_rows_decode_as_rows_launched_one_by_one(monkeypatch):
    """Three left-padded rows (50, 23 and 37 tokens), 24 teacher-forced steps: each row flushes at
    its own steps and the longest outgrows the shared allocation (one flush block of slack here,
    four by default), so the rows are joined anew. The joined launch's
    logits equal the row-by-row launches' to float32 rounding (the split plan counts the batch),
    static steps (device slots and masks) equal dynamic ones bit for bit, and the rows' tensors are
    views of the joint's."""
    monkeypatch.setenv("KVCALIB_BACKEND", "triton")
    model = tiny_model("llama", head_dim=64, heads=4, kv_heads=2).to(DEVICE)
    monkeypatch.setattr(store_module, "MIN_SLACK_BLOCKS", 1)
    recipe, steps = _recipe(), 24
    _, ids, mask = _batch((50, 23, 37), seed=3)
    cache = CompressedCache.from_recipe(model, recipe)
    static = GraphDecoder(model, cache, capture=DEVICE == "cuda", keep_logits=True).generate(
        ids, mask, max_new_tokens=steps)
    layer = cache.layers[1]
    assert layer.ragged and layer.joint is not None
    assert all(row.sink_k._base is layer.joint.sink_k and row.pend_buf_k._base is layer.joint.pend_k
               for row in layer.rows)
    assert layer.joint.counts == tuple(row.packed.stores[0].n for row in layer.rows)
    builds = []
    real = joint_module.JointRows.build

    def counted(lay, previous=None):
        got = real(lay, previous)
        builds.append(got)
        return got

    monkeypatch.setattr(joint_module.JointRows, "build", staticmethod(counted))
    joined, joined_cache = _dynamic_logits(model, recipe, ids, mask, static.tokens)
    assert len([b for b in builds if b is not None]) >= 2 * 2  # both layers joined, then again after outgrowing
    assert all(layer.joint is not None for layer in joined_cache.layers)
    static_logits = torch.stack(static.logits)  # (steps, B, V)
    if DEVICE != "cuda":  # captured graphs replay the same launches; uncaptured they are one computation
        assert torch.equal(static_logits, joined)
    monkeypatch.setattr(joint_module, "row_joinable", lambda row: False)  # every row its own launch
    by_row, by_row_cache = _dynamic_logits(model, recipe, ids, mask, static.tokens)
    assert all(layer.joint is None for layer in by_row_cache.layers)
    tol = 1e-4 * max(1.0, float(by_row.abs().max()))
    assert float((joined - by_row).abs().max()) <= tol
    assert float((static_logits - by_row).abs().max()) <= tol
