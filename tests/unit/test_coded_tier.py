"""Huffman-coded cache snapshots (kvcalib.runtime.coded_tier): bit-exact round trips on real tiny
caches, codebooks that never saw the data, corrupt files, and byte accounting."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvcalib.methods.huffman import StreamLayout, tensor_name
from kvcalib.errors import KvcalibError
from kvcalib.models import model_info
from kvcalib.quant.huffman import HuffmanError, build_codebook, symbol_histogram
from kvcalib.quant.packing import unpack_codes
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe
from kvcalib.runtime.cache import CompressedCache
from kvcalib.runtime.coded_tier import (METADATA_KEY, CodedCache, decode_cache, encode_cache, load_coded,
                                        save_coded)
from tests.conftest import tiny_model

SMALL = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8, sinks=2)  # sinks + window
PER_TOKEN = LayerConfig(k_bits=4, v_bits=2, k_axis="token", k_group=8, v_group=16, window=0)
THREE_BIT = LayerConfig(k_bits=3, v_bits=3, k_group=8, v_group=8, window=8, sinks=2)  # 8 symbols, 2-bit + 1-bit planes
WIDE = LayerConfig(k_bits=8, v_bits=4, k_group=8, v_group=8, window=8, sinks=1)
MIXED = [SMALL, LayerConfig(k_bits=16, v_bits=4, v_group=8, window=0)]  # a 16-bit K side, flush block 1


def _ids(seed: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randint(1, 128, shape, generator=torch.Generator().manual_seed(seed))


def _recipe(model, configs, name="t", **tensors) -> Recipe:
    return Recipe(name=name, layers=list(configs), model=model_info(model.config, "tiny"), tensors=dict(tensors))


def _ott_centred(model) -> Recipe:
    """OTT pools, 8-bit centred values and permuted keys: every optional store part and pool."""
    g = torch.Generator().manual_seed(5)
    t = {}
    for i in range(2):
        t[f"layers.{i}.kv.outlier_pool"] = torch.tensor(2)
        t[f"layers.{i}.v.center"] = torch.tensor(8.0)
        t[f"layers.{i}.k.perm"] = torch.stack([torch.randperm(16, generator=g) for _ in range(2)])
    return _recipe(model, [WIDE, WIDE], "ott", **t)


def _fill(model, recipe, ids, mask=None, steps=0) -> tuple[CompressedCache, torch.Tensor | None]:
    """Prefill ``ids`` (B, T), then ``steps`` greedy tokens one by one; returns the cache and the
    attention mask so far (None without padding)."""
    cache = CompressedCache.from_recipe(model, recipe)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        for _ in range(steps):
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask, past_key_values=cache)
    return cache, mask


def _with_codebooks(recipe: Recipe, calib: CompressedCache, skew: str | None = None) -> Recipe:
    """``recipe`` plus codebooks fitted on another cache's codes (the cache under test never seen);
    ``skew="reverse"`` gives the most frequent symbols the longest code words."""
    tensors = dict(recipe.tensors)
    for i, layer in enumerate(calib.layers):
        view = layer.packed.view()
        for side in "kv":
            codes, bits = getattr(view, f"{side}_codes"), layer.packed.stores[0].bits[side]
            if codes is None:
                continue
            hist = symbol_histogram(unpack_codes(codes, bits), bits)
            if skew == "reverse":
                hist = hist.max() + 1 - hist
            tensors[tensor_name(i, side)] = build_codebook(hist).lengths
    return Recipe(name=recipe.name, layers=recipe.layers, model=recipe.model, tensors=tensors)


def _assert_same_cache(a: CompressedCache, b: CompressedCache) -> None:
    """Every stored tensor and counter equal, bit for bit (a padded batch's layers row by row)."""
    for i, (la, lb) in enumerate(zip(a.layers, b.layers)):
        assert la.ragged == lb.ragged, i
        if la.ragged:
            assert (la.n_seen, la.row_first, la.row_end) == (lb.n_seen, lb.row_first, lb.row_end), i
            for ra, rb in zip(la.rows, lb.rows, strict=True):
                _assert_same_layer(i, ra, rb)
        else:
            _assert_same_layer(i, la, lb)


def _assert_same_layer(i: int, la, lb) -> None:
    assert la.is_initialized == lb.is_initialized, i
    if la.is_initialized:
        assert (la.n_seen, la.pend_start, la.sinks_dropped, la.dtype) == (lb.n_seen, lb.pend_start,
                                                                          lb.sinks_dropped, lb.dtype), i
        for name in ("sink_k", "sink_v", "pend_k", "pend_v"):
            x, y = getattr(la, name), getattr(lb, name)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (i, name)
        for sa, sb in zip(la.packed.stores, lb.packed.stores):
            assert (sa.start, sa.n, sa.bits) == (sb.start, sb.n, sb.bits)
            for name, buf in sa.parts.items():
                x, y = buf.view(), sb.parts[name].view()
                assert (x is None) == (y is None), (i, name)
                assert x is None or (x.dtype == y.dtype and torch.equal(x, y)), (i, name)
        pa, pb = la.outliers.state, lb.outliers.state
        assert (pa is None) == (pb is None)
        if pa is not None:
            for f in ("pool_k", "pool_v", "pool_pos", "extra_k", "extra_v", "extra_pos", "extra_count", "tracking"):
                assert torch.equal(getattr(pa, f), getattr(pb, f)), (i, f)


def _ragged() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, the second left-padded by 11 tokens: ids (2, 22) and attention mask (2, 22)."""
    ids = torch.stack([_ids(2, (1, 22))[0], torch.cat([torch.zeros(11, dtype=torch.long), _ids(3, (1, 11))[0]])])
    return ids, (torch.arange(22)[None] >= torch.tensor([[0], [11]])).long()


CASES = {
    # id: (arch, model kwargs, recipe builder, ids, left-pad mask or None, decode steps)
    "sinks-window-k2v2": ("llama", {}, lambda m: _recipe(m, [SMALL, SMALL]), _ids(0, (1, 45)), None, 3),
    "per-token-k4v2-odd-length": ("llama", {}, lambda m: _recipe(m, [PER_TOKEN, PER_TOKEN]), _ids(1, (1, 37)),
                                  None, 2),
    "ragged-left-padding-gqa": ("qwen2", {}, lambda m: _recipe(m, [SMALL, SMALL]), *_ragged(), 4),
    "sliding-gemma3-sinks-dropped": ("gemma3", {"sliding_window": 8}, lambda m: _recipe(m, [SMALL, SMALL]),
                                     _ids(4, (1, 10)), None, 40),
    "ott-centred-permuted-k8v4": ("llama", {}, _ott_centred, _ids(5, (2, 41)), None, 2),
    "16-bit-side": ("mistral", {}, lambda m: _recipe(m, MIXED), _ids(6, (1, 30)), None, 1),
    "3-bit-k3v3": ("llama", {}, lambda m: _recipe(m, [THREE_BIT, THREE_BIT]), _ids(8, (1, 45)), None, 3),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    arch, kw, build, ids, mask, steps = CASES[request.param]
    model = tiny_model(arch, **kw)
    base = build(model)
    calib, _ = _fill(model, base, _ids(99, (1, 60)))  # codebooks from other text
    recipe = _with_codebooks(base, calib)
    cache, mask = _fill(model, recipe, ids, mask, steps)
    return request.param, model, recipe, cache, mask


def test_round_trip_is_bit_exact_and_attention_identical(case, tmp_path):
    name, model, recipe, cache, mask = case
    coded = encode_cache(cache, side_fallback=False)  # codebooks from cache.recipe
    quantized = {(i, r, s) for i, layer in enumerate(cache.layers) for r, unit in enumerate(layer.rows or [layer])
                 for s in "kv"
                 if getattr(unit.packed.stores[0].parts[f"{s}_codes"].view(), "shape", (0, 0, 0))[2] > 0}
    assert coded.summary()["coded_sides"] == len(quantized) > 0
    restored = decode_cache(load_coded(save_coded(tmp_path / "snap.safetensors", coded)), recipe)
    _assert_same_cache(cache, restored)
    if name == "sliding-gemma3-sinks-dropped":
        assert cache.layers[0].sinks_dropped and cache.layers[0].packed.stores[0].parts["k_codes"].front > 0
    if name == "ragged-left-padding-gqa":  # padding is not held: one unpadded layer per row
        assert cache.layers[0].ragged and [row.n_seen for row in cache.layers[0].rows] == [26, 15]
    if name == "ott-centred-permuted-k8v4":
        assert cache.layers[0].outliers.state is not None and "v_mean_codes" in coded.document["layers"][0][
            "stores"][0]["parts"]
    # identical outputs, also across later flushes
    tok = _ids(7, (cache.layers[0].sink_k.shape[0], 1))
    for step in range(cache.layers[0].cfg.flush_block + 1):
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        with torch.no_grad():
            a = model(input_ids=tok, attention_mask=mask, past_key_values=cache).logits
            b = model(input_ids=tok, attention_mask=mask, past_key_values=restored).logits
        assert torch.equal(a, b), step
        tok = a[:, -1:].argmax(-1)
    _assert_same_cache(cache, restored)


def test_snapshot_does_not_alias_the_live_cache(case):
    _, _, recipe, cache, _ = case
    coded = encode_cache(cache, side_fallback=False)
    before = {k: v.clone() for k, v in coded.tensors.items()}
    restored = decode_cache(coded, recipe)
    unit = (restored.layers[0].rows or [restored.layers[0]])[0]  # a padded batch's layer: its first row
    unit.pend_k.add_(1.0)
    unit.packed.stores[0].parts["v_scale"].view().add_(1.0)
    assert all(torch.equal(before[k], coded.tensors[k]) for k in before)
    second = decode_cache(coded, recipe)
    _assert_same_cache(cache, second)


# ----------------------------------------------------------------------------------------------
# codebooks that did not see the data


@pytest.fixture(scope="module")
def shifted():
    """A real cache and codebooks fitted on it with the symbol frequencies reversed."""
    model = tiny_model("llama")
    base = _recipe(model, [WIDE, WIDE])
    cache, _ = _fill(model, base, _ids(10, (1, 64)))
    matched = _with_codebooks(base, cache)
    reverse = _with_codebooks(base, cache, skew="reverse")
    return model, cache, matched, reverse


def test_shifted_codebooks_cost_bits_never_correctness(shifted):
    model, cache, matched, reverse = shifted
    good = encode_cache(cache, matched, side_fallback=False).summary()
    bad_coded = encode_cache(cache, reverse, side_fallback=False)
    bad = bad_coded.summary()
    assert bad["coded_sides"] == good["coded_sides"] == 4
    assert bad["bits_per_symbol"] > good["bits_per_symbol"]  # the shift costs bits...
    assert bad["raw_stream_fraction"] > 0.5 > good["raw_stream_fraction"]  # ...bounded by the raw escape
    for side, bits in (("k", 8), ("v", 4)):
        streams = bad_coded._streams[("layers.0", 0, side)]  # (unit prefix, store, side)
        assert streams.stream_bits() <= streams.stream_excess.numel() * streams.n_symbols * bits
    _assert_same_cache(cache, decode_cache(bad_coded, reverse))  # ...never correctness


def test_symbols_unseen_in_calibration_still_decode():
    model = tiny_model("llama")
    base = _recipe(model, [PER_TOKEN, PER_TOKEN])
    cache, _ = _fill(model, base, _ids(11, (1, 40)))
    books = {}
    for i in range(2):
        hist = torch.zeros(16, dtype=torch.int64)
        hist[:3] = torch.tensor([50, 30, 20])  # 4-bit K: 13 symbols never seen -> longest code words
        books[(i, "k")] = build_codebook(hist)
    seen = unpack_codes(cache.layers[0].packed.view().k_codes, 4)
    assert int(seen.max()) >= 3  # the cache uses symbols the codebook never saw
    coded = encode_cache(cache, books, side_fallback=False)
    _assert_same_cache(cache, decode_cache(coded, base))


def test_side_fallback_keeps_sides_that_would_grow_packed(shifted):
    _, cache, _, reverse = shifted
    coded = encode_cache(cache, reverse)  # side_fallback=True
    assert coded.document["left_packed"]  # the reversed codes do not pay
    assert coded.total_bytes() <= sum(cache.nbytes().values())
    nb = coded.nbytes()
    assert nb.get("k_packed", 0) + sum(v for k, v in nb.items() if k.startswith("k_huffman")) > 0


@pytest.mark.parametrize("layout", [StreamLayout(4, 8), StreamLayout(8, 8), StreamLayout(5, 10)],
                         ids=["4-token-streams", "one-stream-per-chunk", "5-tokens-not-dividing"])
def test_other_stream_layouts(shifted, layout):
    _, cache, matched, _ = shifted
    coded = encode_cache(cache, matched, layout=layout, side_fallback=False)
    n = cache.layers[0].n_packed  # 48 packed tokens in both layers
    if n % layout.tokens_per_stream:
        assert coded.summary()["coded_sides"] == 0 and len(coded.document["left_packed"]) == 4
    else:
        assert coded.summary()["coded_sides"] == 4
    _assert_same_cache(cache, decode_cache(coded, matched))


# ----------------------------------------------------------------------------------------------
# byte accounting


def test_bytes_count_every_stored_tensor(shifted, tmp_path):
    _, cache, matched, _ = shifted
    coded = encode_cache(cache, matched, side_fallback=False)
    nb = coded.nbytes()
    path = save_coded(tmp_path / "s.safetensors", coded)
    with safe_open(str(path), framework="pt") as f:
        in_file = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    header = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert sum(nb.values()) == coded.total_bytes() == in_file == path.stat().st_size - 8 - header
    packed = cache.nbytes()
    code_bytes = {s: sum(c["packed_bytes"] for ld in coded.document["layers"] for st in ld["stores"]
                         for side, c in st["coded"].items() if side == s) for s in "kv"}
    for key, val in packed.items():  # everything but the coded code planes is carried unchanged
        if key == "window_free":  # the window buffer's free slots: nothing to carry
            continue
        extra = code_bytes[key[0]] if key in ("k_packed", "v_packed") else 0
        assert nb.get(key, 0) + extra == val, key
    streams = coded._streams.values()
    assert nb["k_huffman_payload"] + nb["v_huffman_payload"] == sum(s.nbytes()["payload"] for s in streams)
    assert nb["codebooks"] == 2 * (256 + 16)  # 8-bit K and 4-bit V codebooks of two layers
    s = coded.summary()
    assert s["bytes_packed"] == sum(packed.values()) and s["bytes_coded"] == sum(nb.values())
    assert s["code_bytes_coded"] == sum(v for k, v in nb.items() if "huffman" in k) + nb["codebooks"]
    elements = 2 * 2 * 2 * 16 * cache.layers[0].n_seen  # 2 (K, V) x layers x kv heads x head_dim x T
    assert coded.effective_bits() == pytest.approx(8 * sum(nb.values()) / elements)
    assert s["effective_bits_packed"] == pytest.approx(cache.effective_bits(), abs=1e-4)


# ----------------------------------------------------------------------------------------------
# corrupt files


@pytest.fixture(scope="module")
def saved(shifted, tmp_path_factory):
    _, cache, matched, _ = shifted
    path = save_coded(tmp_path_factory.mktemp("coded") / "snap.safetensors", encode_cache(cache, matched,
                                                                                         side_fallback=False))
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    return path, meta, tensors


P = "layers.0.stores.0.k_codes"  # a coded code plane
S = "layers.1.stores.0.k_scale"  # a carried part


def _all_max(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, torch.iinfo(t.dtype).max)  # every stream longer than raw


def _lie_about_v_scale(doc: dict) -> None:
    doc["layers"][0]["stores"][0]["parts"]["v_scale"][1][2] = 7  # rows along tokens


def _negative_store_length(doc: dict) -> None:
    doc["layers"][0]["stores"][0]["n"] = -8


def _flip(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0] ^= 1 << 31  # the first bit of the first stream: the structure stays valid
    return t


def _doc(meta: dict, edit) -> dict:
    doc = json.loads(meta[METADATA_KEY])
    edit(doc)
    return {METADATA_KEY: json.dumps(doc)}


CORRUPT = {  # id: (edit (meta, tensors) -> (meta, tensors), error type, message pattern)
    "chunk-offsets-out-of-order": (lambda m, t: (m, {**t, f"{P}.chunk_word": t[f"{P}.chunk_word"].flip(-1)
                                                     .contiguous()}), HuffmanError, "runs into the next chunk"),
    "chunk-offset-past-payload": (lambda m, t: (m, {**t, f"{P}.chunk_word": t[f"{P}.chunk_word"] + 10**6}),
                                  HuffmanError, "outside the payload"),
    "truncated-payload": (lambda m, t: (m, {**t, f"{P}.payload": t[f"{P}.payload"][:5].clone()}),
                          HuffmanError, f"{P}.*(outside the payload|guard word)"),
    "stream-length-out-of-range": (lambda m, t: (m, {**t, f"{P}.stream_excess": _all_max(t[f"{P}.stream_excess"])}),
                                   HuffmanError, "stream_excess lies outside"),
    "codebook-not-a-prefix-code": (lambda m, t: (m, {**t, "codebooks.0.v": torch.ones(16, dtype=torch.uint8)}),
                                   HuffmanError, "codebooks.0.v.*Kraft sum"),
    "codebook-wrong-size": (lambda m, t: (m, {**t, "codebooks.0.v": torch.ones(2, dtype=torch.uint8)}),
                            KvcalibError, "codebooks.0.v .*shape mismatch"),
    "scale-shape-mismatch": (lambda m, t: (m, {**t, S: t[S][:, :, 1:].clone()}), KvcalibError,
                             f"{S} .*shape mismatch"),
    "document-shape-lies": (lambda m, t: (_doc(m, _lie_about_v_scale), t), KvcalibError,
                            "v_scale has shape .* does not hold"),
    "missing-tensor": (lambda m, t: (m, {k: v for k, v in t.items() if k != "layers.1.pend_v"}),
                       KvcalibError, "layers.1.pend_v is missing"),
    "unknown-tensor": (lambda m, t: (m, {**t, "layers.0.extra": torch.zeros(1)}), KvcalibError,
                       "layers.0.extra is not part"),
    "malformed-document": (lambda m, t: (_doc(m, _negative_store_length), t), KvcalibError, "malformed"),
    "not-a-snapshot": (lambda m, t: ({"other": "x"}, t), KvcalibError, "not a coded cache snapshot"),
    "payload-bit-flip": (lambda m, t: (m, {**t, f"{P}.payload": _flip(t[f"{P}.payload"])}), KvcalibError,
                         f"{P}.payload fails its CRC-32"),
}


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_corrupt_files_raise_a_clear_error(saved, tmp_path, name):
    path, meta, tensors = saved
    edit, err, match = CORRUPT[name]
    meta2, tensors2 = edit(dict(meta), dict(tensors))
    bad = tmp_path / "bad.safetensors"
    save_file(tensors2, str(bad), metadata=meta2)
    with pytest.raises(err, match=match):
        load_coded(bad)


@pytest.mark.parametrize("keep", [0.5, 0.999], ids=["half", "last-byte-cut"])
def test_truncated_file(saved, tmp_path, keep):
    path, _, _ = saved
    data = path.read_bytes()
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(KvcalibError, match="corrupt or truncated"):
        load_coded(bad)
    with pytest.raises(KvcalibError, match="does not exist"):
        load_coded(tmp_path / "nothing.safetensors")


def test_save_is_atomic_and_loads_back_equal(saved, tmp_path):
    path, _, tensors = saved
    loaded = load_coded(path)
    assert set(loaded.tensors) == set(tensors)
    assert all(torch.equal(loaded.tensors[k], tensors[k]) for k in tensors)
    assert sorted(p.name for p in path.parent.iterdir()) == ["snap.safetensors"]  # no temporary left behind
    assert isinstance(loaded, CodedCache)


# ----------------------------------------------------------------------------------------------
# refusals


def test_refusals(shifted):
    model, cache, matched, _ = shifted
    coded = encode_cache(cache, matched)
    other = _recipe(model, [SMALL, SMALL], "other")
    with pytest.raises(KvcalibError, match="fingerprint"):
        decode_cache(coded, other)
    g = torch.Generator().manual_seed(3)
    permuted = Recipe(name=matched.name, layers=matched.layers, model=matched.model,
                      tensors={**matched.tensors, "layers.0.k.perm": torch.stack([torch.randperm(16, generator=g)
                                                                                  for _ in range(2)])})
    with pytest.raises(KvcalibError, match="fitted tensors differ"):
        decode_cache(coded, permuted)  # same configs, other codec state
    with pytest.raises(KvcalibError, match="needs the recipe"):
        decode_cache(coded)
    with pytest.raises(KvcalibError, match="already holds tokens"):
        decode_cache(coded, into=cache)
    fresh = CompressedCache.from_recipe(model, matched)
    _assert_same_cache(cache, decode_cache(coded, into=fresh))  # into: the recipe comes from the cache
    busy = CompressedCache.from_recipe(model, matched)
    busy.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)  # updated, attention not run yet
    with pytest.raises(KvcalibError, match="has not run attention"):
        encode_cache(busy, matched)
    bare = CompressedCache([WIDE, WIDE])
    with pytest.raises(KvcalibError, match="needs codebooks"):
        encode_cache(bare)
    with pytest.raises(KvcalibError, match="8-bit codes"):
        encode_cache(cache, {(0, "k"): build_codebook(torch.ones(16, dtype=torch.int64))})
