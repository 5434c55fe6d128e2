"""experiments/head_bits.py: the greedy allocations spend exactly the recipe's code bits and go where
the measured damage is, a whole allocation through the hooked attention equals the decode-faithful
simulation of the same per-layer widths, and a run on a tiny llama writes every allocation."""

from __future__ import annotations

import pytest
import torch

from experiments import head_bits as hb
from experiments import head_sensitivity as hs
from kvcalib.layout import LayerConfig
from tests.conftest import corpus_lines, tiny_loaded_model
from tests.unit.test_head_sensitivity import LAST, T, _ids

LAYOUT = dict(k_group=16, v_group=16, sinks=2, window=16)


def _sens(kl: dict) -> dict:
    return {"rows": [{"kind": "head", "layer": l, "head": h, "side": s, "kl": v} for (l, h, s), v in kl.items()]}


@pytest.fixture(scope="module")
def loaded(tiny_tokenizer):
    return tiny_loaded_model(tiny_tokenizer, positions=128)


def test_greedy_spends_the_recipe_budget_on_the_sensitive_heads():
    # 3 layers x 2 heads; one key head carries almost all the damage
    kl = {(l, h, s): 0.001 for l in range(3) for h in range(2) for s in ("k", "v")}
    kl[(1, 0, "k")] = 1.0
    recipe = [(2, 2), (4, 4), (2, 2)]  # 2 x 2 heads x 2 sides x 2 extra bits = 8 extra bits
    allocs = hb.allocations(_sens(kl), recipe, kv_heads=2)
    budget = hb.code_bits(allocs["recipe-layers"])
    assert budget == 2 * 3 * 2 * 2 + 8
    for name in ("layer-greedy", "head-greedy"):
        assert hb.code_bits(allocs[name]) <= budget
    head = allocs["head-greedy"]
    assert head[(1, 0, "k")] == 8  # the one sensitive head goes to the widest width first
    assert head[(1, 1, "k")] < 8  # its layer neighbour does not come along
    assert hb.code_bits(allocs["all-2"]) == 2 * 12
    # a layer-level unit widens both heads of a side at once
    layer = allocs["layer-greedy"]
    assert layer[(1, 0, "k")] == layer[(1, 1, "k")] > 2


def test_missing_sensitivity_rows_are_refused():
    kl = {(0, 0, "k"): 1.0}
    with pytest.raises(SystemExit, match="lacks"):
        hb.allocations(_sens(kl), [(2, 2)], kv_heads=2)


def test_an_allocation_is_the_simulation_of_its_widths(loaded):
    """Layer 1 with head 0 at K3V2 and head 1 at K2V4, layer 0 all 2-bit: the same logits as
    head_sensitivity's per-layer target where every head of the layer has one width (checked
    against kvcalib.simulate in test_head_sensitivity), head by head."""
    from kvcalib.simulate import simulated_logits

    model, ids, p = loaded.model, _ids(loaded), T - LAST
    bits = {(0, h, s): 2 for h in (0, 1) for s in ("k", "v")}
    bits.update({(1, 0, "k"): 3, (1, 0, "v"): 2, (1, 1, "k"): 2, (1, 1, "v"): 4})
    alloc = hb.allocation("mixed", bits, LAYOUT)
    assert [len(alloc.groups[l]) for l in (0, 1)] == [1, 2]
    with hs.hooked(model):
        prefix, _ = hs.prefill(model, ids, p)
        got = hs.continuation_logits(model, ids, prefix, p, alloc, None)  # (B, C, V)
        # uniform widths: an allocation with one group a layer is the simulation of those layer configs
        same = hb.allocation("uniform", {m: 2 if m[0] == 0 else 3 for m in bits}, LAYOUT)
        uniform = hs.continuation_logits(model, ids, prefix, p, same, None)
    layers = [LayerConfig(k_bits=2, v_bits=2, **LAYOUT), LayerConfig(k_bits=3, v_bits=3, **LAYOUT)]
    want = simulated_logits(model, ids, layers, prompt_len=p, logits_to_keep=LAST)
    torch.testing.assert_close(uniform, want, rtol=1e-4, atol=1e-4)
    assert (got - uniform).abs().amax() > 1e-4  # the per-head widths are seen


def test_run_writes_every_allocation(loaded, tmp_path):
    from kvcalib.recipe import Recipe

    sens = tmp_path / "sens.json"
    kl = {(l, h, s): 0.01 * (1 + l + h) for l in (0, 1) for h in (0, 1) for s in ("k", "v")}
    import json

    sens.write_text(json.dumps(_sens(kl)))
    rec = tmp_path / "r.safetensors"
    Recipe(name="t", layers=[LayerConfig(k_bits=2, v_bits=2, **LAYOUT), LayerConfig(k_bits=4, v_bits=3, **LAYOUT)]).save(rec)
    out = tmp_path / "run"
    res = hb.main(["--context", str(T), "--windows", "2", "--score-last", str(LAST), "--group", "16", "--window", "16",
                   "--sinks", "2", "--batch", "2", "--sensitivity", str(sens), "--recipe", str(rec), "--out", str(out)],
                  loaded=loaded, texts=corpus_lines(400))
    kinds = [r["kind"] for r in res["rows"]]
    assert kinds == ["fp", "all-2", "recipe-layers", "layer-greedy", "head-greedy"]
    assert all(r["kl"] > 1e-9 for r in res["rows"] if r["kind"] != "fp")
    assert (out / "head_bits.md").read_text().count("| ") > 10


def test_rotated_allocation_is_the_simulation_of_rotated_layers(loaded):
    """``--rotate``: an allocation with one width a layer, every group's codec Hadamard-rotated, has
    the logits of the decode-faithful simulation of those layers with the rotate method's tensors;
    and rotating changes them."""
    from kvcalib.simulate import simulated_logits

    model, ids, p = loaded.model, _ids(loaded), T - LAST
    d, heads = loaded.info.head_dim, loaded.info.num_kv_heads
    bits = {(l, h, s): 2 + l for l in (0, 1) for h in range(heads) for s in ("k", "v")}
    make = hb.rotating_codec(d)
    rotated = hb.allocation("rotated", bits, LAYOUT, make)
    plain = hb.allocation("plain", bits, LAYOUT)
    with hs.hooked(model):
        prefix, _ = hs.prefill(model, ids, p)
        got = hs.continuation_logits(model, ids, prefix, p, rotated, None)  # (B, C, V)
        unrotated = hs.continuation_logits(model, ids, prefix, p, plain, None)
    layers = [LayerConfig(k_bits=2 + l, v_bits=2 + l, **LAYOUT) for l in (0, 1)]
    codecs = [make(l, tuple(range(heads)), cfg) for l, cfg in enumerate(layers)]
    want = simulated_logits(model, ids, layers, codecs, prompt_len=p, logits_to_keep=LAST)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - unrotated).abs().amax() > 1e-4
