"""Sampling in CUDA-graph decoding: the same answers as its definition, reproducible by seed.

The sampler (:mod:`kvcalib.runtime.sampling`) is checked on hand-made logits: which candidates
top-k and top-p keep, and the frequencies of many seeded draws. Decoding over a compressed cache
runs the static steps eagerly (``capture=False``) through Triton's interpreter on CPU: greedy by
default, seeded sampling reproducible, top-k 1 and a tiny top-p greedy, EOS as before. The
``kvcalib run`` flags are checked through the CLI. On CUDA (device tool) replayed graphs must draw
exactly what the same steps run eagerly draw.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.triton_setup import kernel_modules

DEVICE, INTERPRET, _ = kernel_modules("kvcalib_kernels.decode_attention")  # before any kernel import

from typer.testing import CliRunner  # noqa: E402

from kvcalib.cli import app  # noqa: E402
from kvcalib.errors import KvcalibError  # noqa: E402
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe  # noqa: E402
from kvcalib.runtime.cache import CompressedCache  # noqa: E402
from kvcalib.runtime.graphs import GraphDecoder  # noqa: E402
from kvcalib.runtime.sampling import (  # noqa: E402
    Sampling,
    candidates,
    make_generator,
    sample,
    sampling_from_flags,
)
from tests.conftest import tiny_loaded_model, tiny_model  # noqa: E402

requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (run through the device tool)")
RECIPE = Recipe(name="t", default_layer=LayerConfig(k_bits=2, v_bits=4, k_group=16, v_group=32, window=16, sinks=2))
PROMPT = "The old king walked over the green stone bridge into the market of the north town in 1650."


def _model():
    return tiny_model("llama", head_dim=64, heads=4, kv_heads=2).to(DEVICE)


# ---------------------------------------------------------------- the sampler on hand-made logits


def test_temperature_alone_scales_the_whole_vocabulary():
    logits = torch.randn(3, 37, generator=torch.Generator().manual_seed(0))  # (B, V)
    before = logits.clone()  # (B, V)
    scores, ids = candidates(logits, Sampling(temperature=0.5))
    assert ids is None and torch.equal(scores, logits / 0.5)
    assert torch.equal(logits, before)  # the raw logits stay untouched
    assert candidates(logits, Sampling(top_k=37))[1] is None  # k >= V: top-k is off


@pytest.mark.parametrize("k", [1, 5, 36])
def test_top_k_keeps_exactly_the_k_largest(k):
    logits = torch.randn(4, 37, generator=torch.Generator().manual_seed(k))  # (B, V), no ties
    scores, ids = candidates(logits, Sampling(temperature=2.0, top_k=k))
    assert scores.shape == ids.shape == (4, k)
    for row in range(4):
        assert set(ids[row].tolist()) == set(logits[row].argsort(descending=True)[:k].tolist())
    assert torch.equal(scores, logits.gather(-1, ids) / 2.0)  # scaled, none filtered


# token probabilities, shuffled: sorted 0.5 (id 1), 0.2 (3), 0.15 (4), 0.1 (2), 0.05 (0);
# cumulative 0.5, 0.7, 0.85, 0.95, 1.0 (no p below sits on one of these boundaries)
PROBS = torch.tensor([[0.05, 0.5, 0.1, 0.2, 0.15]])  # (1, 5)


@pytest.mark.parametrize("top_k, top_p, kept", [
    (0, 1e-6, {1}),
    (0, 0.3, {1}),
    (0, 0.69, {1, 3}),
    (0, 0.8, {1, 3, 4}),
    (0, 0.9, {1, 3, 4, 2}),
    (0, 0.99, {1, 3, 4, 2, 0}),
    # after top-k the candidates are renormalised (0.588, 0.235, 0.176), as transformers does:
    # 0.8 is reached by two of them, where over the whole vocabulary it takes three
    (3, 0.8, {1, 3}),
], ids=lambda v: str(v) if not isinstance(v, set) else "")
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_k, top_p, kept):
    scores, ids = candidates(PROBS.log(), Sampling(top_k=top_k, top_p=top_p))
    assert set(ids[torch.isfinite(scores)].tolist()) == kept
    assert torch.isfinite(scores[:, 0]).all()  # the most likely always stays


def _reference_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution ``s`` samples from, written out plainly (V,) float64: softmax of the
    scaled logits, the k largest, then the sorted prefix reaching p, renormalised."""
    probs = torch.softmax(logits.double() / s.temperature, -1)  # (V,)
    order = probs.argsort(descending=True).tolist()
    if s.top_k:
        order = order[:s.top_k]
    total, kept, mass = sum(probs[i].item() for i in order), [], 0.0
    for i in order:
        if mass >= s.top_p * total:
            break
        kept.append(i)
        mass += probs[i].item()
    out = torch.zeros_like(probs)  # (V,)
    out[kept] = probs[kept]
    return out / out.sum()


@pytest.mark.parametrize("s", [Sampling(), Sampling(temperature=0.5), Sampling(temperature=2.0, top_k=3),
                               Sampling(top_p=0.8), Sampling(temperature=1.5, top_k=4, top_p=0.9)],
                         ids=["t1", "t0.5", "t2-k3", "p0.8", "t1.5-k4-p0.9"])
def test_draws_follow_the_filtered_softmax(s):
    """200k seeded draws: every frequency within 0.01 of the reference probability (at most
    ~0.0011 standard deviation: 9 sigma, and the seed makes it deterministic anyway); filtered
    tokens never drawn."""
    logits = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0, -3.0])  # (V,)
    n = 200_000
    tokens = sample(logits.expand(n, -1), s, make_generator("cpu", 0))  # (n, 1)
    assert tokens.shape == (n, 1) and tokens.dtype == torch.long
    freq = torch.bincount(tokens[:, 0], minlength=6).double() / n  # (V,)
    expected = _reference_probs(logits, s)  # (V,)
    assert float((freq - expected).abs().max()) < 0.01, (freq, expected)
    assert float(freq[expected == 0].sum()) == 0.0


def test_top_k_1_and_tiny_top_p_pick_the_argmax():
    logits = 3 * torch.randn(64, 100, generator=torch.Generator().manual_seed(1))  # (B, V)
    greedy = logits.argmax(-1, keepdim=True)  # (B, 1)
    for i, s in enumerate([Sampling(top_k=1), Sampling(temperature=10.0, top_k=1), Sampling(top_p=1e-6),
                           Sampling(temperature=10.0, top_p=1e-6)]):
        assert torch.equal(sample(logits, s, make_generator("cpu", i)), greedy), s


def test_seeds_repeat_and_differ():
    logits = torch.zeros(8, 50)  # (B, V): uniform
    s = Sampling()
    a, b = (sample(logits, s, make_generator("cpu", 3)) for _ in range(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, sample(logits, s, make_generator("cpu", 4)))
    assert make_generator("cpu", None).initial_seed() != make_generator("cpu", None).initial_seed()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(temperature=0.0), "temperature (--temperature) must be a finite number > 0 to sample (got 0.0)"),
    (dict(temperature=-1.0), "(got -1.0)"),
    (dict(temperature=float("nan")), "(got nan)"),
    (dict(temperature=float("inf")), "(got inf)"),
    (dict(top_p=0.0), "top_p (--top-p) must be in (0, 1] (got 0.0)"),
    (dict(top_p=1.5), "(got 1.5)"),
    (dict(top_p=-0.1), "(got -0.1)"),
    (dict(top_k=-1), "top_k (--top-k) must be an integer >= 0 (got -1)"),
    (dict(top_k=2.5), "(got 2.5)"),
    (dict(top_k=True), "(got True)"),
    (dict(seed=-1), "seed (--seed) must be an integer >= 0 or None (got -1)"),
    (dict(seed="1"), "(got '1')"),
], ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_bad_values_raise(kwargs, needle):
    with pytest.raises(KvcalibError) as err:
        Sampling(**kwargs)
    assert needle in str(err.value)


def test_flags_map_to_sampling():
    assert sampling_from_flags(0.0) is None
    assert sampling_from_flags(0.0, seed=5) is None  # greedy needs no seed: harmless
    assert sampling_from_flags(0.7, 40, 0.9, 1) == Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=1)
    with pytest.raises(KvcalibError, match="--temperature 0 .the default. decodes greedily"):
        sampling_from_flags(0.0, top_k=5)
    with pytest.raises(KvcalibError, match=r"top_p \(--top-p\) must be in"):
        sampling_from_flags(0.0, top_p=1.5)  # checked even when greedy
    with pytest.raises(KvcalibError, match="--temperature must be a finite number >= 0"):
        sampling_from_flags(-0.5)


# ---------------------------------------------------------------- decoding (static steps, eagerly)


@pytest.fixture(scope="module")
def decoding():
    """A tiny model, a prompt batch (B=2, T=8) and a greedy run of 6 tokens with its logits."""
    model = _model()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3)).to(DEVICE)  # (B, T)
    return model, ids, _decode(model, ids, None)


def _decode(model, ids, sampling, **kw):
    cache = CompressedCache.from_recipe(model, RECIPE)
    return GraphDecoder(model, cache, capture=False, keep_logits=True, sampling=sampling).generate(
        ids, max_new_tokens=6, **kw)


def test_greedy_stays_the_default(decoding):
    """No sampling: every token, the first (from the prefill) included, is the argmax of its logits."""
    _, _, greedy = decoding
    assert greedy.tokens.shape == (2, 6) and len(greedy.logits) == 6
    assert torch.equal(greedy.tokens, torch.stack([x.argmax(-1) for x in greedy.logits], 1))


def test_seeded_sampling_repeats_and_keeps_raw_logits(decoding):
    model, ids, greedy = decoding
    hot = Sampling(temperature=5.0, seed=1)  # nearly flat over 128 tokens
    a, b = _decode(model, ids, hot), _decode(model, ids, hot)
    other = _decode(model, ids, dataclasses.replace(hot, seed=2))
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, other.tokens)
    assert not torch.equal(a.tokens[:, 0], other.tokens[:, 0])  # the first token is sampled too
    assert not torch.equal(a.tokens, greedy.tokens)
    # the kept logits are the model's, not the sampler's scaled scores: the prefill's are the
    # greedy run's, bit for bit
    assert torch.equal(a.logits[0], greedy.logits[0])
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("s", [Sampling(top_k=1, seed=3), Sampling(temperature=2.0, top_p=1e-6, seed=3)],
                         ids=["top-k-1", "tiny-top-p"])
def test_top_k_1_and_tiny_top_p_decode_greedily(decoding, s):
    model, ids, greedy = decoding
    assert torch.equal(_decode(model, ids, s).tokens, greedy.tokens)


def test_eos_ends_a_sampled_sequence(decoding):
    """EOS as with greedy decoding: a row repeats ``pad_token_id`` after its first EOS; the other
    row draws what it drew without EOS (the noise does not depend on what was chosen)."""
    model, ids, _ = decoding
    s = Sampling(temperature=5.0, seed=9)
    free = _decode(model, ids, s)
    eos, pad = int(free.tokens[0, 2]), 127
    ended = _decode(model, ids, s, eos_token_id=eos, pad_token_id=pad)
    expected = free.tokens.clone()  # (B, 6)
    for row in range(2):
        hits = (expected[row] == eos).nonzero()
        if len(hits):
            expected[row, int(hits[0]) + 1:] = pad
    assert torch.equal(ended.tokens, expected)


def test_decoder_refuses_a_sampling_that_is_not_one(decoding):
    model, _, _ = decoding
    with pytest.raises(KvcalibError, match="sampling must be a kvcalib.runtime.sampling.Sampling"):
        GraphDecoder(model, CompressedCache.from_recipe(model, RECIPE), capture=False, sampling={"temperature": 1})


# ---------------------------------------------------------------- kvcalib run


@pytest.mark.parametrize("flags, needle", [
    (["--temperature", "0.8", "--top-p", "1.5"], "top_p (--top-p) must be in (0, 1] (got 1.5)"),
    (["--temperature", "0.8", "--top-p", "0"], "top_p (--top-p) must be in (0, 1] (got 0.0)"),
    (["--temperature", "1", "--top-k", "-2"], "top_k (--top-k) must be an integer >= 0 (got -2)"),
    (["--temperature=-1"], "--temperature must be a finite number >= 0 (got -1.0)"),
    (["--top-k", "5"], "--temperature 0 (the default) decodes greedily"),
    (["--temperature", "1", "--seed", "-3"], "seed (--seed) must be an integer >= 0 or None (got -3)"),
], ids=["top-p-1.5", "top-p-0", "top-k-negative", "temperature-negative", "top-k-greedy", "seed-negative"])
def test_run_refuses_bad_sampling_flags(monkeypatch, flags, needle):
    """Exit code 2, one line naming the value, before any model loads."""
    def no_model(*args, **kwargs):
        raise AssertionError("the flags must be checked before the model loads")

    monkeypatch.setattr("kvcalib.models.load_model", no_model)
    result = CliRunner().invoke(app, ["run", "--recipe", "kivi-4", "--prompt", "hi", "--device", "cpu", *flags])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1


def test_run_samples_reproducibly_and_qualifies_the_agreement(monkeypatch, tiny_tokenizer):
    """`kvcalib run --temperature ... --seed S --compare` (eager path, tiny model): the same seed
    prints the same text; the agreement line says what a sampled comparison is worth."""
    loaded = tiny_loaded_model(tiny_tokenizer, head_dim=64)
    monkeypatch.setattr("kvcalib.models.load_model", lambda *args, **kwargs: loaded)
    base = ["run", "--recipe", "kivi-4", "--prompt", PROMPT, "--device", "cpu", "--max-new-tokens", "8", "--compare"]
    sampled = [*base, "--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--seed", "3"]
    runs = [CliRunner().invoke(app, sampled) for _ in range(2)]
    for r in runs:
        assert r.exit_code == 0, r.output
        assert "token agreement with full precision" in r.output
        assert "(sampled, seed 3: past the first token that differs, agreement is mostly chance" in r.output
    texts = [[line for line in r.output.splitlines() if line.startswith(("[kivi-4]", "[full precision]"))]
             for r in runs]
    assert texts[0] == texts[1] and len(texts[0]) == 2
    greedy = CliRunner().invoke(app, base)
    assert greedy.exit_code == 0, greedy.output
    assert "token agreement with full precision" in greedy.output and "(sampled" not in greedy.output


# ---------------------------------------------------------------- CUDA graphs (GPU)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0, seed=11),
                                      Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=12),
                                      Sampling(temperature=1.2, top_p=0.8, seed=13)],
                         ids=["temperature", "top-k-top-p", "top-p"])  # top-p alone: torch.sort captured
def test_replayed_sampling_draws_what_eager_steps_draw(sampling):
    """The decoder's generator is registered with every captured graph: a replay draws what the
    same step run eagerly draws, so with one seed both give the same tokens across flush periods
    (float32 model: no near-ties between the two runs' roundings); another seed differs."""
    model = _model()
    ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(2)).to(DEVICE)  # (B, T)
    mask = torch.ones_like(ids)  # (B, T)
    mask[2, :9] = 0
    runs = []
    reseeded = dataclasses.replace(sampling, seed=sampling.seed + 100)
    for capture, s in ((False, sampling), (True, sampling), (True, reseeded)):
        cache = CompressedCache.from_recipe(model, RECIPE)
        runs.append(GraphDecoder(model, cache, capture=capture, keep_logits=True, sampling=s).generate(
            ids, mask, max_new_tokens=70))
    eager, graph, other = runs
    # every decode step after the prompt's token ran in a graph: captured (one per flush period) or replayed
    assert graph.captures >= 4 and graph.captures + graph.replays == 69
    assert torch.equal(eager.tokens, graph.tokens)
    assert float((torch.stack(eager.logits) - torch.stack(graph.logits)).abs().max()) < 1e-2
    assert not torch.equal(graph.tokens, other.tokens)


@pytest.mark.gpu
@requires_cuda
def test_kvcalib_run_cuda_graph_sampling_repeats_with_a_seed(tiny_tokenizer):
    """`kvcalib run --cuda-graph --temperature ... --seed S`'s generation path: the same seed, the same text."""
    from kvcalib.runtime.generate import generate

    loaded = tiny_loaded_model(tiny_tokenizer, head_dim=64)
    loaded.model.to(DEVICE)
    s = Sampling(temperature=1.5, top_k=50, seed=5)
    a, b = (generate(loaded, PROMPT, RECIPE, max_new_tokens=48, cuda_graph=True, sampling=s) for _ in range(2))
    assert a.new_tokens == b.new_tokens and a.text == b.text
    greedy = generate(loaded, PROMPT, RECIPE, max_new_tokens=48, cuda_graph=True)
    assert a.new_tokens != greedy.new_tokens
