"""Planned side bytes (issue 53): the search's allocation counts, without fitting, the most bytes each
side-scoped method's fit will store (``Method.planned_side_bytes``), so a learned rotation's
matrices are paid for when bits are allocated, not found over the budget afterwards.

Every registered side-scoped method is fitted on a tiny random model's statistics (2 kv heads,
head_dim 16) and must store no more than it planned; the rotation kinds exactly that where they
rotate. The greedy allocation with learned rotations then keeps the fully fitted recipe in its budget.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcalib.layout import LayerConfig
from kvcalib.methods import registry
from kvcalib.methods.base import TensorSpec, shape_symbols
from kvcalib.models import model_info
from tests.conftest import tiny_model

HEADS, HEAD_DIM, CONTEXT = 2, 16, 512
# K per channel and per token, 2/3/4/8 bits, groups of 8 (levels fits at 2 and 4 bits only)
CONFIGS = [LayerConfig(k_bits=2, v_bits=4, k_group=8, v_group=8),
           LayerConfig(k_bits=4, v_bits=2, k_axis="token", k_group=8, v_group=8),
           LayerConfig(k_bits=3, v_bits=8, k_axis="token", k_group=8, v_group=8)]


def _side_scoped() -> dict[str, type]:
    return {name: m for name, m in registry().items() if all(spec.sides != ("kv",) for spec in m.tensors)}


def _instances():
    """Every side-scoped method at its defaults, the rotation at each kind."""
    for name, cls in _side_scoped().items():
        if name == "rotate":
            yield from (cls(kind=kind) for kind in ("hadamard", "pca", "learned", "learned-head"))
        elif name == "huffman":  # its most: every side coded, the histograms kept too
            yield cls(store_histograms=True, only_if_smaller=False)
        else:
            yield cls()


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer llama (4 query heads, 2 kv heads of 16), its statistics (4 blocks of 16 tokens each
    layer) and 2 scoring windows."""
    from kvcalib.collection import collect_stats

    model = tiny_model("llama", layers=2, heads=4, kv_heads=HEADS, head_dim=HEAD_DIM)
    info = model_info(model.config, "tiny-llama")
    g = torch.Generator().manual_seed(0)
    stats = collect_stats(model, torch.randint(0, 128, (4, 32), generator=g), reservoir_blocks=4, block_len=16,
                          name="tiny-llama", progress=False)
    return model, info, stats, torch.randint(0, 128, (2, 40), generator=g)


def test_shape_strings_count_their_largest_alternative_and_run_nothing():
    cfg = LayerConfig(k_bits=2, v_bits=4, k_group=8, v_group=8)
    k, v = shape_symbols("k", cfg, 3, 64), shape_symbols("v", cfg, 3, 64)
    assert (k["C"], v["C"]) == (64, 8)  # per-channel keys: one column per channel; values: per group
    for shape, dtype, symbols, size in [("()", "float32", k, 4), ("(3,)", "int64", k, 24), ("(H, 1)", "float32", k, 12),
                                        ("(H, C)", "float32", v, 3 * 8 * 4), ("(2**bits,)", "uint8", v, 16),
                                        ("(R/2 + 1,)", "float32", k, 33 * 4),
                                        ("(H, D, D) | (D, D)", "float32", k, 3 * 64 * 64 * 4)]:
        assert TensorSpec("t", ("k",), dtype, shape, "").max_bytes(symbols) == size, shape
    for bad in ("__import__('os').getcwd()", "(H, x)", "(H.real,)", "H", "(H, D", "(H ** D.bit_length(),)"):
        with pytest.raises(ValueError, match="shape"):
            TensorSpec("t", ("k",), "float32", bad, "").max_bytes(k)
    with pytest.raises(ValueError, match="dtype"):
        TensorSpec("t", ("k",), "float99", "()", "").max_bytes(k)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["k2v4-channel", "k4v2-token", "k3v8-token"])
def test_every_side_method_stores_at_most_what_it_planned(tiny, cfg):
    from kvcalib.calibrate import fit_layer

    _, _, stats, _ = tiny
    matrices = set()
    for method in _instances():
        for layer in range(len(stats.layers)):
            fitted = fit_layer(stats.layers[layer], cfg, [method], heads=HEADS, head_dim=HEAD_DIM)
            for side in ("k", "v"):
                stored = sum(t.numel() * t.element_size() for key, t in fitted.items() if key.startswith(f"{side}."))
                planned = method.planned_side_bytes(side, cfg, HEADS, HEAD_DIM)
                assert stored <= planned, (method, layer, side)
                if method.name != "rotate" or method.kind == "pca":
                    continue
                # a rotated side stores exactly what was planned: the gain and this kind's rotation
                if f"{side}.rotation" in fitted or (method.kind == "hadamard" and f"{side}.rotate" in fitted):
                    assert stored == planned, (method, layer, side)
                    matrices.add(method.kind)
    assert {"learned", "learned-head"} <= matrices  # the equality was checked where matrices are kept


def test_a_side_kept_at_16_bits_plans_nothing():
    cfg = LayerConfig(k_bits=16, v_bits=2, v_group=8)
    for method in _instances():
        assert method.planned_side_bytes("k", cfg, HEADS, HEAD_DIM) == 0
    assert registry()["rotate"](kind="learned").planned_side_bytes("v", cfg, HEADS, HEAD_DIM) == 4 + HEAD_DIM ** 2 * 4


def test_learned_rotations_are_paid_for_when_bits_are_allocated(tiny):
    """The greedy allocation with the rotation refitted as learned: before issue 53's planned bytes
    it allocated as if the matrices were free and the fitted recipe came out over its budget."""
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import SearchSpace
    from kvcalib.optimize.study import greedy_point

    model, info, stats, ids = tiny
    learned = {"rotate": registry()["rotate"](kind="learned")}
    plain = SearchObjective(model, info, stats, ids, context=CONTEXT)
    refit = SearchObjective(model, info, stats, ids, context=CONTEXT, method_overrides=learned)
    space = SearchSpace(bits=(2, 4, 8), groups=(8,), windows=(8,), sinks=(0,), layer_methods=("rotate",))
    # groups of 8 cost 4 bits of fp16 scale and zero an element: 2-bit codes everywhere are 6.66 bits
    budget, sensitivity = 8.0, [1.0, 2.0]
    as_searched = greedy_point(plain, space, sensitivity, budget, ("rotate",))  # Hadamard seeds planned
    point = greedy_point(refit, space, sensitivity, budget, ("rotate",))
    # every fitted tensor counted, the learned matrices included (a matrix a side: 0.125 bits here)
    assert refit.effective_bits(point) <= budget
    assert refit.effective_bits(as_searched) > budget  # the matrices did not fit the searched layout
    assert any(k.endswith(".rotation") for k in refit.fitted_tensors(point))  # and the pick does rotate
    # the allocation's count: the whole-layer tensors fitted, the side ones planned (an upper bound)
    layout_only = plain.effective_bits(dataclasses.replace(point, methods=((),) * 2), with_tensors="layers")
    elements = 2 * HEADS * HEAD_DIM * CONTEXT * 2
    assert refit.effective_bits(point, with_tensors="layers") == pytest.approx(
        layout_only + 8.0 * refit.planned_side_bytes(point) / elements)
    assert refit.planned_side_bytes(point) == refit.planned_side_bytes(point, only={"rotate"}) == \
        sum(4 + HEAD_DIM ** 2 * 4 for cfg in point.layer_configs() for b in (cfg.k_bits, cfg.v_bits) if b < 16)
