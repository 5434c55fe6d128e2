"""The search objective: decode-faithful KL(full precision || compressed) on held calibration text.

For a point of the space (:class:`~kvcalib.optimize.space.Point`) we fit its recipe tensors on the
collected statistics (clip/center/reorder/outliers where the point switches them on, and the
point's schedule; cached per (layer, config, methods) since trials share them), build the
runtime codecs (:meth:`~kvcalib.recipe.Recipe.codecs`, which carries every applied tensor),
and run
:func:`~kvcalib.simulate.simulated_logits` on each scoring sequence. The score of one sequence is

    KL = mean over positions t in [prompt_len, T) of  sum_v p_fp(v | <t) (log p_fp - log p_hat)

For long contexts (``score_last`` = N) the window's first T - N tokens are the prompt -- attended in
full precision by themselves, then compressed, as a long prompt is in use -- and the KL is the mean
over the last N positions, the decode steps at the target context; only those positions' logits
are computed (``logits_to_keep``), so a 32k window costs no (T, V) tensor.

the next-token distribution's divergence from full precision, exactly as token-by-token decoding
through the compressed cache would produce it (one teacher-forced forward). The full-precision
log-probabilities are computed once per sequence and cached (float32 ``(T, V)`` each).

The scoring sequences must be disjoint from the sequences the statistics were collected on
(:func:`kvcalib.optimize.scoring_sequences` takes the calibration windows after the
collected ones), so the search does not reward overfitting the fitted tensors.

Memory, the second objective / constraint, is ``Recipe.memory(info, context).effective_bits`` of
the candidate recipe, fitted tensors included (DESIGN.md accounting; 4096 tokens by default).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvcalib.models import ModelInfo
from kvcalib.optimize.space import Point
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe
from kvcalib.stats import CollectedStats


def kl_to_reference(ref_logp: torch.Tensor, logits: torch.Tensor, start: int = 1) -> float:
    """Mean over positions ``[start, T)`` of KL(ref || softmax(logits)); ref_logp, logits ``(T, V)``."""
    ref = ref_logp[start:].double()  # (T', V)
    logq = torch.log_softmax(logits[start:].double(), dim=-1)  # (T', V)
    kl = (ref.exp() * (ref - logq)).sum(-1)  # (T',)
    return float(kl.clamp_min(0.0).mean()) if kl.numel() else 0.0


class SearchObjective:
    """Scores points on fixed sequences against cached full-precision distributions.

    Args:
        model: a causal LM (eval mode) whose caches ``info`` describes.
        stats: statistics collected on *other* sequences than ``ids`` (for the fitted tensors).
        ids: scoring sequences, LongTensor ``(M, T)``.
        context: context length (tokens) at which effective bits are accounted.
    """

    def __init__(self, model, info: ModelInfo, stats: CollectedStats | None, ids: torch.Tensor, *,
                 context: int = 4096, seed: int = 0, prompt_len: int = 1, score_last: int | None = None) -> None:
        if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
            raise ValueError(f"ids must be (M >= 1, T >= 2) token ids, got {tuple(ids.shape)}")
        if score_last is not None:
            if not 1 <= score_last < ids.shape[1]:
                raise ValueError(f"score_last must lie in [1, {ids.shape[1]}), got {score_last}")
            prompt_len = ids.shape[1] - score_last  # the rest is a long prompt, compressed after its attention
        self.model, self.info, self.stats = model, info, stats
        self.ids = ids  # (M, T)
        self.context, self.seed, self.prompt_len = context, seed, prompt_len
        # logits kept per forward: only the scored positions of a long window (None: all)
        self.keep = score_last
        self._ref: dict[int, torch.Tensor] = {}  # sequence -> (T, V) float32 log-probs
        self._fitted: dict[tuple, dict[str, torch.Tensor]] = {}
        self.simulations = 0  # forwards run (for timing reports)

    @property
    def n_sequences(self) -> int:
        return int(self.ids.shape[0])

    # ------------------------------------------------------------------ recipes
    def fitted_tensors(self, point: Point, *, sides: bool = True, layers: bool = True) -> dict[str, torch.Tensor]:
        """Recipe tensors ``layers.{i}.*`` of ``point``.

        ``sides``: the switched methods that fit K and V apart (``side_scoped``: center,
        reorder, clip...), fitted together per (layer, side, bits, group, methods) with the other
        side uncompressed: each fits K and V independently and ignores window and sinks, so
        trials that share a layer's side share its fit (cached).
        ``layers``: the whole-layer tensors ``layers.{i}.kv.*``: each switched whole-layer method
        (e.g. OTT's outlier pool), fitted per layer and bits/groups (cached), and the point's
        schedule (static tiers, :class:`~kvcalib.methods.schedule.ScheduleMethod`).
        """
        from kvcalib.calibrate import fit_layer
        from kvcalib.optimize.space import schedule_ages, side_scoped

        out: dict[str, torch.Tensor] = {}
        configs = point.layer_configs()
        ages = schedule_ages(point.schedule)
        for i, (cfg, methods) in enumerate(zip(configs, point.methods or ((),) * len(configs))):
            if not cfg.compressed:
                continue
            side_methods = tuple(m for m in methods if side_scoped(m))
            layer_methods = tuple(m for m in methods if not side_scoped(m))
            if (side_methods and sides) or (layer_methods and layers):
                if self.stats is None:
                    raise ValueError("method switches need collected statistics")
            for side, bits in (("k", cfg.k_bits), ("v", cfg.v_bits)):
                if bits >= 16 or not side_methods or not sides:
                    continue
                key = (i, side, bits, cfg.k_axis, cfg.k_group, cfg.v_group, side_methods)
                if key not in self._fitted:
                    one = LayerConfig(k_bits=bits if side == "k" else 16, v_bits=bits if side == "v" else 16,
                                      k_axis=cfg.k_axis, k_group=cfg.k_group, v_group=cfg.v_group)
                    fitted = fit_layer(self.stats.layers[i], one, list(side_methods), self.seed,
                                       heads=self.info.num_kv_heads, head_dim=self.info.head_dim)
                    self._fitted[key] = {k: t for k, t in fitted.items() if k.startswith(f"{side}.")}
                out.update({f"layers.{i}.{name}": t for name, t in self._fitted[key].items()})
            if not layers:
                continue
            for method in layer_methods:
                # e.g. OTT reads the key reservoir at the layer's key bits/groups (window and sinks unused)
                key = (i, method, cfg.k_bits, cfg.v_bits, cfg.k_axis, cfg.k_group, cfg.v_group)
                if key not in self._fitted:
                    fitted = fit_layer(self.stats.layers[i], LayerConfig(
                        k_bits=cfg.k_bits, v_bits=cfg.v_bits, k_axis=cfg.k_axis, k_group=cfg.k_group,
                        v_group=cfg.v_group), [method], self.seed,
                        heads=self.info.num_kv_heads, head_dim=self.info.head_dim)
                    self._fitted[key] = {k: t for k, t in fitted.items() if k.startswith("kv.")}
                out.update({f"layers.{i}.{name}": t for name, t in self._fitted[key].items()})
            if ages:
                key = (i, "schedule", ages, tuple(sorted(cfg.to_dict().items())))
                if key not in self._fitted:
                    self._fitted[key] = self._schedule_tensors(i, cfg, ages)
                out.update({f"layers.{i}.{name}": t for name, t in self._fitted[key].items()})
        return out

    def _schedule_tensors(self, i: int, cfg: LayerConfig, ages: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """``kv.schedule`` of one layer: ScheduleMethod on the layer's statistics; without
        statistics (the floor check before collection) the same static tiers directly."""
        from kvcalib.methods import get

        schedule = get("schedule")(ages)  # PATS, through the registry: the space's schedules are its ages
        if self.stats is not None:
            fitted = schedule.fit(self.stats.layers[i], cfg, self.seed, heads=self.info.num_kv_heads,
                                  head_dim=self.info.head_dim)
            return {k: t for k, t in fitted.items() if k.startswith("kv.")}
        return schedule.static_tensors(cfg)

    def recipe(self, point: Point, name: str = "searched", provenance: dict | None = None) -> Recipe:
        return Recipe(name=name, layers=point.layer_configs(), model=self.info,
                      tensors=self.fitted_tensors(point), provenance=dict(provenance or {}))

    def effective_bits(self, point: Point, with_tensors: bool | str = True) -> float:
        """Effective bits of ``point`` at ``context``: with every fitted tensor (True), with the
        whole-layer tensors only (``"layers"``: outlier pool and schedule, which change memory;
        cheap, for allocation moves) or with none (False: the layer configs alone)."""
        if with_tensors == "layers":
            tensors = self.fitted_tensors(point, sides=False)
        else:
            tensors = self.fitted_tensors(point) if with_tensors else {}
        rec = Recipe(name="p", layers=point.layer_configs(), model=self.info, tensors=tensors)
        return rec.memory(self.info, self.context).effective_bits

    # ------------------------------------------------------------------ KL
    def reference(self, m: int) -> torch.Tensor:
        """Full-precision next-token log-probs of sequence ``m``, (T, V) float32 (computed once)."""
        if m not in self._ref:
            keep = {"logits_to_keep": self.keep} if self.keep else {}
            with torch.no_grad():
                logits = self.model(input_ids=self.ids[m:m + 1].to(self._device), use_cache=False, **keep).logits[0]
            logp = torch.log_softmax(logits.float(), dim=-1).cpu()  # (T, V)
            # held in host memory (every sequence's (T, V) would crowd the GPU), pinned there so
            # that each trial's copy back to the device is one fast DMA
            self._ref[m] = logp.pin_memory() if logits.is_cuda else logp
        return self._ref[m]

    @property
    def _device(self):
        return next(self.model.parameters()).device

    def kl_configs(self, configs: Sequence[LayerConfig], tensors: dict[str, torch.Tensor] | None = None,
                   sequences: Sequence[int] | None = None,
                   report: Callable[[int, float], None] | None = None) -> float:
        """Mean KL over ``sequences`` (default all) of the recipe given by ``configs`` + ``tensors``.

        ``report(step, running_mean)`` is called after each sequence (Optuna pruning raises there).
        """
        from kvcalib.simulate import simulated_logits

        configs = list(configs)
        rec = Recipe(name="candidate", layers=configs, model=self.info, tensors=dict(tensors or {}))
        codecs = rec.codecs(self.info)
        seqs = list(range(self.n_sequences)) if sequences is None else list(sequences)
        total = 0.0
        for step, m in enumerate(seqs):
            ref = self.reference(m)
            if any(c.compressed for c in configs):
                logits = simulated_logits(self.model, self.ids[m:m + 1].to(self._device), configs, codecs,
                                          self.prompt_len, self.keep or 0)[0]  # (T | keep, V)
                self.simulations += 1
                # the KL where the logits are: on a GPU, float64 over (512, V) on the host took most
                # of a trial, and workers sharing the host's cores slowed each other 2-10x
                total += kl_to_reference(ref.to(logits.device, non_blocking=True), logits,
                                         0 if self.keep else self.prompt_len)
            if report is not None:
                report(step, total / (step + 1))
        return total / max(len(seqs), 1)

    def kl(self, point: Point, sequences: Sequence[int] | None = None,
           report: Callable[[int, float], None] | None = None) -> float:
        return self.kl_configs(point.layer_configs(), self.fitted_tensors(point), sequences, report)

    def kl_recipe(self, recipe: Recipe, sequences: Sequence[int] | None = None) -> float:
        """KL of any recipe (a preset included) on the same sequences."""
        configs = recipe.layer_configs(self.info.num_layers)
        return self.kl_configs(configs, recipe.tensors, sequences)
