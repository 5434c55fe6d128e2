"""``kvcalib run`` on first use (issue 35): the time to the first token (prefill, and the Triton
compilation on first use) is reported apart from the warm decode rate, and a prompt too short for
anything to leave the full-precision window says so instead of passing for a compressed run."""

from __future__ import annotations

import math

from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe
from kvcalib.runtime.generate import _split_time, generate, too_short_note
from tests.conftest import corpus_lines, tiny_loaded_model

RECIPE = Recipe(name="k2v2-w16", default_layer=LayerConfig(k_bits=2, v_bits=2, k_group=16, v_group=16, window=16))


def test_split_time_separates_the_first_token_from_the_warm_rate():
    first, rate = _split_time(10.0, [12.5, 12.6, 12.7, 12.9])
    assert math.isclose(first, 2.5) and math.isclose(rate, 3 / 0.4)
    none_first, none_rate = _split_time(0.0, [])
    assert none_first is None and math.isnan(none_rate)
    one_first, one_rate = _split_time(1.0, [1.5])
    assert one_first == 0.5 and math.isnan(one_rate)


def test_a_short_prompt_is_named_and_a_long_one_compresses(tiny_tokenizer):
    loaded = tiny_loaded_model(tiny_tokenizer)
    short = generate(loaded, "the cat", RECIPE, max_new_tokens=4)
    assert short.compressed_tokens == 0 and short.prompt_tokens > 0
    note = too_short_note(short, RECIPE)
    assert note is not None and "nothing was compressed" in note and "16 tokens" in note
    long = generate(loaded, " ".join(corpus_lines(40)), RECIPE, max_new_tokens=6)
    assert long.prompt_tokens > 64 and long.compressed_tokens > 0 and too_short_note(long, RECIPE) is None
    # per-token times: a first-token time and a warm rate, both from the streamer's clock
    assert long.first_token_seconds is not None and 0 < long.first_token_seconds <= long.seconds
    assert long.decode_tokens_per_second > 0 and len(long.new_tokens) == 6


def test_the_short_prompt_note_reads_a_fitted_recipes_layers(tiny_tokenizer):
    """A fitted recipe has a config per layer and no default layer: the note names the widest
    window + sinks of its compressed layers (a 16-bit layer never compresses)."""
    loaded = tiny_loaded_model(tiny_tokenizer)
    n = loaded.info.num_layers
    layers = [LayerConfig(k_bits=2, v_bits=2, k_group=16, v_group=16, window=16)] * (n - 1) + [
        LayerConfig(k_bits=4, v_bits=4, k_group=16, v_group=16, window=32, sinks=4)]
    fitted = Recipe(name="fitted", layers=layers, model=loaded.info)
    short = generate(loaded, "the cat", fitted, max_new_tokens=3)
    note = too_short_note(short, fitted)
    assert note is not None and "32 tokens, 4 sinks" in note and "over 36 tokens" in note
    fp = Recipe(name="fp", layers=[LayerConfig(k_bits=16, v_bits=16)] * n, model=loaded.info)
    assert too_short_note(generate(loaded, "the cat", fp, max_new_tokens=2), fp) is None

