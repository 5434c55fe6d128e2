"""Padded batches are exact: a padded row holds, and attends over, exactly what the same prompt
alone would (issue 33 item 4). Sinks, the window, flush blocks, OTT pools and PATS ages count from
the row's first real token, and padding is never stored (``kvcalib/runtime/cache.py``).

Two levels, on the reference path in float64:

- the layer: K/V fed to one :class:`CompressedLayer` as a padded batch and to one layer per prompt
  alone give bit-identical stored tensors and attention outputs (``torch.equal``), for every preset
  and recipe feature, left padding, right padding and both;
- the model: a left-padded batch's logits per row equal each prompt alone's within the float64
  noise of the full-precision model itself, which is not bit-exact padded vs alone (a (B*T, d)
  matmul rounds a row differently than a (T, d) one) -- before this change the rows differed by
  0.25-0.69 in the logits (the docstring of :func:`test_left_padded_batch_logits_equal_each_prompt_alone`).
"""

from __future__ import annotations

import pytest
import torch

from kvcalib.methods.schedule import Schedule
from kvcalib.errors import KvcalibError
from kvcalib.recipe import LayerConfig, Recipe, resolve_recipe
from kvcalib.runtime.backend import decode_attention
from kvcalib.runtime.reference import attend_compressed
from kvcalib.runtime.cache import CompressedCache, CompressedLayer
from kvcalib.codec import LayerCodec
from tests.conftest import tiny_model

H, D, REP = 2, 64, 2  # kv heads, head_dim, query heads per kv head
FITTED = LayerConfig(k_bits=2, v_bits=2, k_group=16, v_group=32, window=16, sinks=4)


def _preset(name: str) -> LayerConfig:
    return resolve_recipe(name).default_layer


def _codec(feature: str) -> tuple[LayerConfig, LayerCodec, int | None]:
    """(config, codec, sliding window) of one recipe feature."""
    g = torch.Generator().manual_seed(11)
    if feature in ("kivi-2", "kivi-4", "pertoken-4"):
        cfg = _preset(feature)
        return cfg, LayerCodec(cfg), None
    if feature == "fitted":  # sinks, groups, clip per head, a permutation and a centred side
        perm = torch.stack([torch.randperm(D, generator=g) for _ in range(H)])
        clip = torch.tensor([0.8, 0.7])[None, :, None, None]  # (1, H, 1, 1), as state.build_codecs gives it
        return FITTED, LayerCodec(FITTED, k_clip=clip, v_clip=0.75, k_perm=perm, v_center=8), None
    if feature == "ott":
        return FITTED, LayerCodec(FITTED, outlier_pool=3), None
    if feature == "pats":
        cfg = LayerConfig(k_bits=8, v_bits=4, k_group=16, v_group=32, window=16, sinks=4)
        return cfg, LayerCodec(cfg, schedule=Schedule.from_layer(cfg, (40, 72)), outlier_pool=2), None
    if feature == "sliding":
        return FITTED, LayerCodec(FITTED), 40
    raise ValueError(feature)


def _visible(n_seen: int, tq: int, sliding: int | None, real: torch.Tensor | None) -> torch.Tensor:
    """(B|1, Tq, n_seen) bool: causal (and windowed) over absolute positions, padding hidden."""
    q = torch.arange(n_seen - tq, n_seen)[:, None]
    k = torch.arange(n_seen)[None, :]
    vis = k <= q
    if sliding is not None:
        vis &= k > q - sliding
    vis = vis[None]
    return vis if real is None else vis & real[:, None, :n_seen]


def _run(feature: str, chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], real: torch.Tensor | None):
    """Feed ``chunks`` ((k, v, q) of (B, H, T, D), (B, H, T, D), (B, H*REP, T, D)) to a fresh layer
    as attention does: update, commit, attend (reference), flush. ``real`` (B, total) bool or None.
    Returns the layer and each chunk's output (B, T, Hq, D)."""
    cfg, codec, sliding = _codec(feature)
    layer = CompressedLayer(cfg, codec, sliding_window=sliding)
    outs = []
    for k, v, q in chunks:
        layer.update(k, v)
        vis = _visible(layer.n_seen, k.shape[2], sliding, real)
        steps = torch.arange(k.shape[2])
        layer.commit(vis[:, steps, layer.n_seen - k.shape[2] + steps])  # a real token sees itself
        outs.append(decode_attention(q, layer, vis, D ** -0.5, path="reference"))  # rows split there, as in a model
        layer.flush()
    return layer, outs


def _assert_same_layer(a: CompressedLayer, b: CompressedLayer) -> None:
    """Every stored tensor and counter equal, bit for bit."""
    assert (a.n_seen, a.pend_start, a.sinks_dropped) == (b.n_seen, b.pend_start, b.sinks_dropped)
    for name in ("sink_k", "sink_v", "pend_k", "pend_v"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for sa, sb in zip(a.packed.stores, b.packed.stores, strict=True):
        assert (sa.start, sa.n) == (sb.start, sb.n)
        for name, buf in sa.parts.items():
            x, y = buf.view(), sb.parts[name].view()
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
    pa, pb = a.outliers.state, b.outliers.state
    assert (pa is None) == (pb is None)
    if pa is not None:
        for f in ("pool_k", "pool_v", "pool_pos", "extra_k", "extra_v", "extra_pos", "extra_count", "tracking"):
            assert torch.equal(getattr(pa, f), getattr(pb, f)), f
    assert a.nbytes() == b.nbytes()


def _tokens(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V (1, H, n, D) and queries (1, H*REP, n, D), float64; keys with an outlier channel."""
    k = torch.randn(1, H, n, D, generator=g, dtype=torch.float64) * 2
    k[..., 5] += 6.0
    return k, torch.randn(1, H, n, D, generator=g, dtype=torch.float64), \
        torch.randn(1, H * REP, n, D, generator=g, dtype=torch.float64)


FEATURES = ["kivi-2", "kivi-4", "pertoken-4", "fitted", "ott", "pats", "sliding"]


@pytest.mark.parametrize("padding", ["left", "right", "both"])
@pytest.mark.parametrize("feature", FEATURES)
def test_padded_layer_holds_and_attends_exactly_what_each_prompt_alone_does(feature, padding):
    """A 3-row batch (real lengths 171, 165, 200) through a prompt chunk of 205 positions and (left
    padding) 12 decode steps, or (right padding: teacher-forced batches) two prompt chunks: each
    row's stored tensors and outputs are those of its prompt alone, bit for bit (float64)."""
    g = torch.Generator().manual_seed(3)
    lens, width = (171, 165, 200), 205
    rows = [_tokens(n, g) for n in lens]
    lead = {"left": [width - n for n in lens], "right": [0, 0, 0], "both": [2, 30, 5]}[padding]
    real = torch.zeros(3, width, dtype=torch.bool)
    full = [torch.zeros(3, H * m, width, D, dtype=torch.float64) for m in (1, 1, REP)]  # k, v, q
    for i, (n, a) in enumerate(zip(lens, lead)):
        real[i, a:a + n] = True
        for t, x in zip(full, rows[i]):
            t[i, :, a:a + n] = x[0]
    cut = [width] if padding == "left" else [120, width]  # right padding: a chunked teacher-forced prefill
    chunks, at = [], 0
    for c in cut:
        chunks.append(tuple(t[:, :, at:c] for t in full))
        at = c
    # alone: the same prompt chunks (without the padding), so the same sums are taken in the same order
    alone_chunks = []
    for i, (n, a) in enumerate(zip(lens, lead)):
        spans = [(max(s, a) - a, min(e, a + n) - a) for s, e in zip([0] + cut[:-1], cut)]  # row-relative
        alone_chunks.append([tuple(x[:, :, lo:hi] for x in rows[i]) for lo, hi in spans if hi > lo])
    if padding == "left":  # decode steps: one real token per row
        for _ in range(12):
            step = [_tokens(1, g) for _ in lens]
            chunks.append(tuple(torch.cat([s[j] for s in step]) for j in range(3)))
            for i, s in enumerate(step):
                alone_chunks[i].append(s)
        real = torch.cat([real, torch.ones(3, 12, dtype=torch.bool)], 1)
    batch, outs = _run(feature, chunks, real)
    assert batch.ragged and batch.row_first == lead
    for i, n in enumerate(lens):
        alone, alone_outs = _run(feature, alone_chunks[i], None)
        _assert_same_layer(batch.rows[i], alone)
        assert alone.n_packed > 0, "the prompt must have flushed blocks, or the test proves little"
        got = torch.cat([o[i] for o in outs])[real[i]]  # the row's real queries, in order
        assert torch.equal(got, torch.cat([o[0] for o in alone_outs]))
        assert not bool(torch.cat([o[i] for o in outs])[~real[i]].any()), "a query at padding attends to nothing"
    assert batch.nbytes() == {k: sum(_run(feature, alone_chunks[i], None)[0].nbytes()[k] for i in range(3))
                              for k in batch.nbytes()}, "every byte held is counted, and no byte for padding"


def test_padding_between_real_tokens_is_refused():
    layer = CompressedLayer(FITTED)
    k = torch.randn(2, H, 6, D)
    layer.update(k, k)
    with pytest.raises(KvcalibError, match="batch row 1 has padding between real tokens"):
        layer.commit(torch.tensor([[True] * 6, [True, True, False, True, True, True]]))
    layer = CompressedLayer(FITTED)
    layer.update(k, k)
    layer.commit(torch.tensor([[True] * 6, [True] * 4 + [False] * 2]))  # right padding
    layer.flush()
    layer.update(k[:, :, :1], k[:, :, :1])
    with pytest.raises(KvcalibError, match="padding_side = 'left'"):  # a real token after the padding
        layer.commit(torch.ones(2, 1, dtype=torch.bool))


# ---------------------------------------------------------------- the model (float64, reference)


def _fitted_recipe() -> Recipe:
    """Sinks 4, groups 16/32, window 16, K2V2 + a K4V4 layer, clip per head, an OTT pool on layer 0,
    PATS tiers (4 -> 2 bits at age 40) on layer 1."""
    l1 = LayerConfig(k_bits=4, v_bits=4, k_group=16, v_group=32, window=16, sinks=4)
    tensors = {f"layers.{i}.{s}.clip": torch.tensor([[0.8], [0.7]]) for i in range(2) for s in "kv"}
    tensors["layers.0.kv.outlier_pool"] = torch.tensor(3)
    tensors["layers.1.kv.schedule"] = Schedule.from_layer(l1, (40,)).to_tensor()
    return Recipe(name="fitted-like", layers=[FITTED, l1], tensors=tensors)


def _teacher_forced(model, recipe, ids, mask, new):
    """Prefill ``ids`` (B, T) under ``mask``, then feed ``new`` (B, n) one by one: logits (B, 1 + n, V)
    of the prompt's last position and of each fed token. ``recipe`` None: transformers' DynamicCache."""
    from transformers import DynamicCache

    b, t = ids.shape
    full = torch.cat([mask, mask.new_ones((b, new.shape[1]))], 1)
    pos = (full.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config) if recipe is None else CompressedCache.from_recipe(model, recipe)
    with torch.no_grad():
        out = [model(input_ids=ids, attention_mask=mask, position_ids=pos[:, :t], past_key_values=cache).logits[:, -1]]
        for i in range(new.shape[1]):
            out.append(model(input_ids=new[:, i:i + 1], attention_mask=full[:, :t + i + 1],
                             position_ids=pos[:, t + i:t + i + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(out, 1), cache


def padded_vs_alone(model, recipe, seqs: list[torch.Tensor], new: torch.Tensor) -> tuple[float, list]:
    """Left-pad ``seqs`` into one batch and teacher-force ``new`` (B, n) after it, then each prompt
    alone: the largest |logit difference| of a row against its prompt alone, and the caches alone."""
    width = max(len(s) for s in seqs)
    ids = torch.stack([torch.cat([torch.zeros(width - len(s), dtype=torch.long), s]) for s in seqs])
    mask = (torch.arange(width)[None] >= torch.tensor([[width - len(s)] for s in seqs])).long()
    batch, _ = _teacher_forced(model, recipe, ids, mask, new)
    diff, caches = 0.0, []
    for i, s in enumerate(seqs):
        alone, cache = _teacher_forced(model, recipe, s[None], torch.ones((1, len(s)), dtype=torch.long), new[i:i + 1])
        diff = max(diff, float((batch[i] - alone[0]).abs().max()))
        caches.append(cache)
    return diff, caches


def test_left_padded_batch_logits_equal_each_prompt_alone(monkeypatch):
    """Prompts of 200, 165 and 181 tokens left-padded into one batch, 10 teacher-forced tokens, the
    reference path in float64: each row's logits equal the prompt alone's within the full-precision
    model's own padded-vs-alone noise (5.6e-16 here: matmul rounding), for every preset and a fitted
    recipe with sinks, clip, mixed bits, an OTT pool and PATS tiers. Before rows were anchored to
    their first real token (the same check on this CPU, prompts 420/170/301, 24 tokens) the padded
    rows differed by 0.675 (kivi-2), 0.248 (kivi-4), 0.690 (fitted) in the logits."""
    monkeypatch.setenv("KVCALIB_BACKEND", "reference")
    model = tiny_model("llama", head_dim=64).double()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 128, (n,), generator=g) for n in (200, 165, 181)]
    new = torch.randint(1, 128, (3, 10), generator=g)
    noise, _ = padded_vs_alone(model, None, seqs, new)  # transformers' own cache: not bit-exact padded vs alone
    assert noise < 1e-8
    for recipe in ("kivi-2", "kivi-4", "pertoken-4", _fitted_recipe()):
        diff, caches = padded_vs_alone(model, recipe, seqs, new)
        assert all(c.layers[0].n_packed > 0 for c in caches), "the recipe must quantize, or the test proves little"
        assert diff <= 4 * noise + 1e-12, getattr(recipe, "name", recipe)


def test_right_padded_teacher_forced_batch_scores_each_row_as_alone():
    """Right padding (teacher-forced batches): the real positions' logits equal the prompt alone's,
    and the rows hold what the prompts alone would (bytes included)."""
    model = tiny_model("qwen2", head_dim=64)
    g = torch.Generator().manual_seed(5)
    lens = (90, 57)
    seqs = [torch.randint(1, 128, (n,), generator=g) for n in lens]
    ids = torch.stack([torch.cat([s, torch.full((90 - len(s),), 7)]) for s in seqs])
    mask = (torch.arange(90)[None] < torch.tensor([[n] for n in lens])).long()
    recipe = _fitted_recipe()
    cache = CompressedCache.from_recipe(model, recipe)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
    total = {}
    for i, s in enumerate(seqs):
        alone_cache = CompressedCache.from_recipe(model, recipe)
        with torch.no_grad():
            alone = model(input_ids=s[None], past_key_values=alone_cache).logits
        torch.testing.assert_close(batch[i, :len(s)], alone[0], atol=1e-5, rtol=1e-5)
        for layer, alone_layer in zip(cache.layers, alone_cache.layers):
            assert layer.rows[i].n_seen == len(s) and layer.rows[i].n_packed == alone_layer.n_packed > 0
        for k, v in alone_cache.nbytes().items():
            total[k] = total.get(k, 0) + v
    assert cache.nbytes() == total


# ---------------------------------------------------------------- one place splits the rows


def _functions_reading(path, names: set[str]) -> set[str]:
    """Functions (outermost ``def`` names) of the module at ``path`` that read an attribute in ``names``."""
    import ast

    found = set()
    for top in ast.parse(path.read_text()).body:
        if isinstance(top, (ast.FunctionDef, ast.ClassDef)):
            for node in ast.walk(top):
                if isinstance(node, ast.Attribute) and node.attr in names:
                    found.add(top.name)
    return found


def test_padded_rows_are_split_for_attention_in_one_place():
    """Issue 52 item 4: ``backend.decode_attention`` is the one function that splits a padded batch
    into its rows for attention (dynamic and static steps, every path); the paths below it --
    reference, kernel, static kernel -- and the attention entry never read a layer's rows, and
    ``attend_rows`` has that one caller. ``layer_graphs`` reads them to decide whether a layer may
    run static at all (not how it is attended)."""
    from pathlib import Path

    import kvcalib

    root = Path(kvcalib.__file__).parent
    runtime = root / "runtime"
    readers = {name: _functions_reading(runtime / f"{name}.py", {"rows", "ragged"})
               for name in ("backend", "triton_path", "reference", "attention", "static", "graphs")}
    assert readers == {"backend": {"decode_attention"}, "triton_path": set(), "reference": set(),
                       "attention": set(), "static": set(), "graphs": set()}
    callers = {(path.relative_to(root).as_posix(), fn) for path in root.rglob("*.py")
               for fn in _functions_reading(path, {"attend_rows"})}
    assert callers == {("runtime/backend.py", "decode_attention")}


def test_the_reference_refuses_a_padded_batch_layer():
    """A padded batch's layer holds nothing in its own tensors (its rows do): the reference path
    refuses it instead of attending an empty layer, and names where rows are split."""
    layer = CompressedLayer(FITTED)
    k = torch.randn(2, H, 40, D)
    layer.update(k, k)
    layer.commit(torch.tensor([[True] * 40, [False] * 8 + [True] * 32]))
    layer.flush()
    q, vis = torch.randn(2, H * REP, 1, D), _visible(40, 1, None, None)
    with pytest.raises(KvcalibError, match="backend.decode_attention"):
        attend_compressed(q, layer, vis, D ** -0.5)
    out = decode_attention(q, layer, vis, D ** -0.5, path="reference")
    for i, row in enumerate(layer.rows):
        alone = attend_compressed(q[i:i + 1], row, _visible(row.n_seen, 1, None, None), D ** -0.5)
        assert torch.equal(out[i:i + 1], alone)


def test_a_padded_decode_step_reads_which_tokens_are_real_once_per_forward(monkeypatch):
    """Which of a step's tokens are real comes to the host once per forward, not once per layer:
    the layers share their attention mask (each device-to-host copy waits for the GPU's queue)."""
    import kvcalib.runtime.attention as attention

    model = tiny_model("llama", layers=3, head_dim=32)
    ids = torch.randint(1, 100, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # row 1 left-padded
    copies = []
    real_host_rows = attention._host_rows

    def counted(attention_mask, real, seen):
        had = getattr(attention_mask, "_kvcalib_real", None)
        rows = real_host_rows(attention_mask, real, seen)
        if had is None or had[0] != (seen, tuple(real.shape)):
            copies.append(seen)
        return rows

    monkeypatch.setattr(attention, "_host_rows", counted)
    cache = CompressedCache.from_recipe(model, Recipe(name="t", layers=[FITTED] * 3))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3,
                             do_sample=False, pad_token_id=0)
    assert out.shape == (2, 15) and all(layer.ragged for layer in cache.layers)
    assert copies == [12, 13, 14]  # the prompt and two decode steps (tokens seen): one copy each, 3 layers
