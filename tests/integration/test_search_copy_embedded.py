"""Issue 53 item 2 on the real embedded SmolLM2-135M, which copies (a random tiny model does not):
the search's copy windows catch a recipe that destroys far-back keys, which the ordinary windows
barely see (< 15 s on a 2-core CPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.embedded


def test_copy_windows_catch_destroyed_far_back_keys():
    from kvcalib.data import load_texts, pack_samples
    from kvcalib.eval.copy import copy_windows
    from kvcalib.layout import LayerConfig
    from kvcalib.models import load_model
    from kvcalib.optimize.objective import SearchObjective

    loaded = load_model("smollm2-135m", device="cpu")
    n_layers = loaded.info.num_layers
    ids = pack_samples(load_texts("embedded", "calib"), loaded.tokenizer, 192, 1, seed=0)  # (1, 192)
    copies = copy_windows(ids, 16).ids  # (1, 192): the last 32 tokens repeat the first 32
    objective = SearchObjective(loaded.model, loaded.info, None, ids, context=4096, score_last=16, copy_ids=copies)
    with torch.no_grad():
        # keys and values at 2 bits beyond the 32 most recent tokens (4 sinks kept): far back is destroyed
        destroyed = objective.parts_configs([LayerConfig(k_bits=2, v_bits=2, window=32, sinks=4)] * n_layers)
        # the same window at 8 bits: far back kept
        kept = objective.parts_configs([LayerConfig(k_bits=8, v_bits=8, window=32, sinks=4)] * n_layers)
    assert destroyed.copy > 10 * kept.copy, (destroyed, kept)
    # the ordinary window's last steps lean on the recent tokens; the copy's can only read far back
    assert destroyed.copy > 4 * destroyed.ordinary, destroyed
