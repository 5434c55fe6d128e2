"""The parity check every compression method passes: fitted on a tiny model's statistics, the
decode-faithful simulation gives the logits of a token-by-token decode through the runtime cache,
and the method changes what is decoded (so the check can fail)."""

from __future__ import annotations

import torch

from kvcalib.calibrate import fit_stats
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe
from kvcalib.simulate import simulated_logits
from tests.unit.test_cache import decode_logits


def assert_decode_faithful(model, stats, methods: list, cfg: LayerConfig, state: str) -> Recipe:
    """Fit ``methods`` on every layer of ``stats`` at ``cfg``; every layer's codec must carry the
    state ``state``; simulation == decode within 1e-3, and != the plain recipe's decode. Returns
    the fitted recipe."""
    info = stats.model
    configs = [cfg] * info.num_layers
    rec = Recipe(name=state, layers=configs, model=info, tensors=fit_stats(stats, configs, methods))
    assert all(c.state(state) is not None for c in rec.codecs(info))
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(3))
    dec, _ = decode_logits(model, ids, rec, 1)
    sim = simulated_logits(model, ids, configs, rec.codecs(info), prompt_len=1)
    assert float((sim - dec).abs().max()) < 1e-3
    plain, _ = decode_logits(model, ids, Recipe(name="plain", layers=configs, model=info), 1)
    assert float((plain - dec).abs().max()) > 1e-3, f"{state} changes what is decoded"
    return rec


def assert_costs_only_its_tensors(rec: Recipe, info, context: int = 256) -> None:
    """``rec`` holds at ``context`` exactly the bytes of the same layers without fitted tensors,
    plus its recipe tensors (a method that changes no per-token storage)."""
    plain = Recipe(name="plain", layers=rec.layers, model=info)
    extra = sum(t.numel() * t.element_size() for t in rec.tensors.values())
    assert rec.memory(info, context).total_bytes == plain.memory(info, context).total_bytes + extra
