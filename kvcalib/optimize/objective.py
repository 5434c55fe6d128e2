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

Copy windows (issue 53): with ``score_last``, the search may also score one copy window per scoring
window (:func:`kvcalib.eval.copy.copy_windows`: the window's tail replaced by a copy of its start,
so its scored decode steps can be predicted only by reading far back through the compressed
cache). The objective is then the weighted geometric mean of the two parts

    KL = KL_ordinary ** (1 - w) * KL_copy ** w        (w = ``copy_weight``, 0.5 by default)

each part the mean KL per scored decode step (nats) of its windows. Why geometric: the parts differ
in scale (SmolLM2-135M, 2-bit keys behind a 32-token window: the copy part 5-25x the ordinary one),
so an arithmetic mean would be the copy part alone, and a recipe could buy copying with perplexity;
with the product a relative change counts the same in either part (at w = 0.5, doubling one part is
paid only by halving the other), as users judge them: Δppl in %, copy NLL as a multiple of full
precision's. It is 0 only for a recipe no scored step sees quantized (both parts 0), is in nats
like either part, and a running value over the windows scored so far is comparable between trials
at the same step (the pruner's need). :class:`KLParts` keeps the two parts apart for the report.

The scoring sequences must be disjoint from the sequences the statistics were collected on
(:func:`kvcalib.optimize.scoring_sequences` takes the calibration windows after the
collected ones), so the search does not reward overfitting the fitted tensors.

Memory, the second objective / constraint, is ``Recipe.memory(info, context).effective_bits`` of
the candidate recipe, fitted tensors included (DESIGN.md accounting; 4096 tokens by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

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


def rotation_overrides(kind: str | None) -> dict[str, Any]:
    """The :class:`SearchObjective` ``method_overrides`` that fit the rotate switch as ``kind``
    (``kvcalib search --rotate KIND``, and ``kvcalib export RUN --trial N`` rebuilding or refitting a
    searched point): ``{"rotate": RotateMethod(kind)}``, or none where ``kind`` is None or the
    method's default configuration (the objective fits that anyway, so the default search is
    unchanged). A kind the method does not know is a :class:`~kvcalib.errors.KvcalibError`
    naming the kinds (the method's own flag parser)."""
    from kvcalib.methods import registry

    if kind is None:
        return {}
    method = registry()["rotate"]
    rotation = method.from_flags({"rotate": kind}, LayerConfig())
    return {} if rotation.config() == method().config() else {rotation.name: rotation}


@dataclass(frozen=True)
class KLParts:
    """The objective of one recipe and its parts, each a mean KL per scored decode step (nats);
    a part is None where none of its windows was scored."""

    ordinary: float | None  # the ordinary scoring windows
    copy: float | None  # the copy windows
    copy_weight: float = 0.0  # the copy part's exponent in :attr:`value`

    @property
    def value(self) -> float:
        """``ordinary ** (1 - w) * copy ** w`` (module docstring); one part alone where the other is
        missing (a running value after the first window, or a search without copy windows)."""
        if self.copy is None or self.copy_weight == 0.0:
            return self.ordinary if self.ordinary is not None else (self.copy or 0.0)
        if self.ordinary is None:
            return self.copy
        return self.ordinary ** (1.0 - self.copy_weight) * self.copy ** self.copy_weight


class SearchObjective:
    """Scores points on fixed sequences against cached full-precision distributions.

    Args:
        model: a causal LM (eval mode) whose caches ``info`` describes.
        stats: statistics collected on *other* sequences than ``ids`` (for the fitted tensors).
        ids: scoring sequences, LongTensor ``(M, T)``.
        context: context length (tokens) at which effective bits are accounted.
        copy_ids: copy windows, LongTensor ``(C, T)`` (:func:`kvcalib.eval.copy.copy_windows`),
            scored like ``ids`` on their last ``score_last`` positions (which they need); None: none.
        copy_weight: the copy part's weight (exponent) in the objective (:class:`KLParts`).

    Windows are numbered ``0..M-1`` (ordinary), then ``M..M+C-1`` (copy); ``sequences`` arguments
    take these numbers.
    """

    def __init__(self, model, info: ModelInfo, stats: CollectedStats | None, ids: torch.Tensor, *,
                 context: int = 4096, seed: int = 0, prompt_len: int = 1, score_last: int | None = None,
                 copy_ids: torch.Tensor | None = None, copy_weight: float = 0.5,
                 method_overrides: dict[str, Any] | None = None) -> None:
        if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
            raise ValueError(f"ids must be (M >= 1, T >= 2) token ids, got {tuple(ids.shape)}")
        if score_last is not None:
            if not 1 <= score_last < ids.shape[1]:
                raise ValueError(f"score_last must lie in [1, {ids.shape[1]}), got {score_last}")
            prompt_len = ids.shape[1] - score_last  # the rest is a long prompt, compressed after its attention
        if copy_ids is not None:
            if score_last is None:  # the copy is the window's tail: only its decode steps are scored
                raise ValueError("copy windows need score_last (their scored tail is the copy)")
            if copy_ids.dim() != 2 or copy_ids.shape[1] != ids.shape[1]:
                raise ValueError(f"copy_ids must be (C, {ids.shape[1]}) token ids, got {tuple(copy_ids.shape)}")
            if not 0.0 <= copy_weight < 1.0:
                raise ValueError(f"copy_weight must lie in [0, 1), got {copy_weight}")
        self.model, self.info, self.stats = model, info, stats
        self.ids = ids  # (M, T)
        self.n_ordinary = int(ids.shape[0])
        self.n_copy = 0 if copy_ids is None else int(copy_ids.shape[0])
        self.copy_weight = copy_weight if self.n_copy else 0.0
        # every scored window, ordinary first: (M + C, T)
        self.windows = ids if copy_ids is None else torch.cat([ids, copy_ids.to(ids.dtype)])
        self.context, self.seed, self.prompt_len = context, seed, prompt_len
        # logits kept per forward: only the scored positions of a long window (None: all)
        self.keep = score_last
        self._ref: dict[int, torch.Tensor] = {}  # sequence -> (T, V) float32 log-probs
        self._fitted: dict[tuple, dict[str, torch.Tensor]] = {}
        # a switched method fitted as this configured instance instead of its defaults (name -> Method:
        # `kvcalib export RUN --trial N --rotate learned` refits a searched point's rotations learned)
        self.method_overrides = dict(method_overrides or {})
        self.simulations = 0  # forwards run (for timing reports)

    @property
    def n_sequences(self) -> int:
        """Windows scored per trial, ordinary and copy (the pruner's steps)."""
        return self.n_ordinary + self.n_copy

    def order(self) -> list[int]:
        """Every window, an ordinary one and a copy one in turn (then the rest): a pruned trial's
        running value has seen both kinds from its second step on."""
        ordinary, copies = list(range(self.n_ordinary)), list(range(self.n_ordinary, self.n_sequences))
        out = [m for pair in zip(ordinary, copies) for m in pair]
        return out + ordinary[len(copies):] + copies[len(ordinary):]

    @property
    def sweep_sequences(self) -> list[int]:
        """The windows of the per-layer sensitivity sweep: the first ordinary one, and the first copy
        one where there are copy windows (a layer that carries the copying is then found sensitive)."""
        return [0] + ([self.n_ordinary] if self.n_copy else [])

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
                    fitted = fit_layer(self.stats.layers[i], one,
                                       [self.method_overrides.get(m, m) for m in side_methods], self.seed,
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
                        v_group=cfg.v_group), [self.method_overrides.get(method, method)], self.seed,
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

    def side_method(self, name: str):
        """The configured instance a side method ``name`` of a point is fitted as: its override
        (:attr:`method_overrides`), else its default configuration (as :func:`kvcalib.calibrate.build_methods`)."""
        from kvcalib.methods import registry

        return self.method_overrides.get(name) or registry()[name]()

    def planned_side_bytes(self, point: Point, only: Collection[str] | None = None) -> float:
        """The most bytes the point's side-scoped methods' fits store (``{k|v}.*`` recipe tensors:
        a rotation's seed or matrix, clip scales...), counted without fitting them
        (:meth:`~kvcalib.methods.base.Method.planned_side_bytes`, overrides applied), over every
        quantized side of every compressed layer, plus what their states change in the stored
        bytes (:meth:`~kvcalib.methods.base.Method.planned_state_bytes`: 8-bit scale pairs give
        bytes back); ``only``: those methods alone."""
        from kvcalib.optimize.space import side_scoped

        from kvcalib.layout import held_tokens, quantized_token_count

        heads, head_dim = self.info.num_kv_heads, self.info.head_dim
        total = 0.0
        for i, (cfg, methods) in enumerate(zip(point.layer_configs(), point.methods or ())):
            for name in methods:
                if not side_scoped(name) or (only is not None and name not in only):
                    continue
                method = self.side_method(name)
                total += sum(method.planned_side_bytes(side, cfg, heads, head_dim)
                             for side in ("k", "v") if cfg.bits(side) < 16)
                if cfg.compressed:  # a state that changes the stored bytes per token (8-bit scale pairs)
                    kept = held_tokens(self.context, self.info.sliding_window[i])
                    total += method.planned_state_bytes(cfg, heads, head_dim, kept, quantized_token_count(cfg, kept))
        return total

    def recipe(self, point: Point, name: str = "searched", provenance: dict | None = None) -> Recipe:
        return Recipe(name=name, layers=point.layer_configs(), model=self.info,
                      tensors=self.fitted_tensors(point), provenance=dict(provenance or {}))

    def effective_bits(self, point: Point, with_tensors: bool | str = True) -> float:
        """Effective bits of ``point`` at ``context``: with every fitted tensor (True, exact), with
        the whole-layer tensors fitted and the side methods' tensors planned (``"layers"``: outlier
        pool and schedule, which change memory, plus :meth:`planned_side_bytes`, the most the side
        fits store -- a learned rotation's matrices -- without fitting them; cheap, for allocation
        moves) or with none (False: the layer configs alone).

        ``"layers"`` leaves out what the runtime derives from the side tensors (a seed's signs, one
        Walsh-Hadamard per head_dim: :meth:`~kvcalib.methods.base.MethodState.bytes`); the check
        with every tensor (:func:`~kvcalib.optimize.study.fit_to_budget`, each trial's bits) counts them."""
        planned = 0
        if with_tensors == "layers":
            tensors = self.fitted_tensors(point, sides=False)
            planned = self.planned_side_bytes(point)
        else:
            tensors = self.fitted_tensors(point) if with_tensors else {}
        rec = Recipe(name="p", layers=point.layer_configs(), model=self.info, tensors=tensors)
        mem = rec.memory(self.info, self.context)
        return 8.0 * (mem.total_bytes + planned) / mem.elements

    # ------------------------------------------------------------------ KL
    def reference(self, m: int) -> torch.Tensor:
        """Full-precision next-token log-probs of sequence ``m``, (T, V) float32 (computed once)."""
        if m not in self._ref:
            keep = {"logits_to_keep": self.keep} if self.keep else {}
            with torch.no_grad():
                logits = self.model(input_ids=self.windows[m:m + 1].to(self._device), use_cache=False, **keep).logits[0]
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
        """The objective (:attr:`KLParts.value`) over ``sequences`` of the recipe given by ``configs`` +
        ``tensors`` (:meth:`parts_configs`)."""
        return self.parts_configs(configs, tensors, sequences, report).value

    def parts_configs(self, configs: Sequence[LayerConfig], tensors: dict[str, torch.Tensor] | None = None,
                      sequences: Sequence[int] | None = None,
                      report: Callable[[int, float], None] | None = None) -> KLParts:
        """Mean KL over ``sequences`` (default all, in :meth:`order`) of the recipe given by ``configs``
        + ``tensors``, the ordinary and the copy windows apart.

        ``report(step, running_value)`` is called after each window (Optuna pruning raises there).
        """
        from kvcalib.simulate import simulated_logits

        configs = list(configs)
        rec = Recipe(name="candidate", layers=configs, model=self.info, tensors=dict(tensors or {}))
        codecs = rec.codecs(self.info)
        seqs = self.order() if sequences is None else list(sequences)
        totals, counts = [0.0, 0.0], [0, 0]  # [ordinary, copy]
        for step, m in enumerate(seqs):
            part = int(m >= self.n_ordinary)
            ref = self.reference(m)
            if any(c.compressed for c in configs):
                logits = simulated_logits(self.model, self.windows[m:m + 1].to(self._device), configs, codecs,
                                          self.prompt_len, self.keep or 0)[0]  # (T | keep, V)
                self.simulations += 1
                # the KL where the logits are: on a GPU, float64 over (512, V) on the host took most
                # of a trial, and workers sharing the host's cores slowed each other 2-10x
                totals[part] += kl_to_reference(ref.to(logits.device, non_blocking=True), logits,
                                                0 if self.keep else self.prompt_len)
            counts[part] += 1
            if report is not None:
                report(step, self._parts(totals, counts).value)
        return self._parts(totals, counts)

    def _parts(self, totals: list[float], counts: list[int]) -> KLParts:
        ordinary, copy = (t / c if c else None for t, c in zip(totals, counts))
        return KLParts(ordinary, copy, self.copy_weight)

    def kl(self, point: Point, sequences: Sequence[int] | None = None,
           report: Callable[[int, float], None] | None = None) -> float:
        return self.parts(point, sequences, report).value

    def parts(self, point: Point, sequences: Sequence[int] | None = None,
              report: Callable[[int, float], None] | None = None) -> KLParts:
        """:meth:`parts_configs` of a point of the space."""
        return self.parts_configs(point.layer_configs(), self.fitted_tensors(point), sequences, report)

    def kl_recipe(self, recipe: Recipe, sequences: Sequence[int] | None = None) -> float:
        """KL of any recipe (a preset included) on the same sequences."""
        return self.parts_recipe(recipe, sequences).value

    def parts_recipe(self, recipe: Recipe, sequences: Sequence[int] | None = None) -> KLParts:
        """:meth:`parts_configs` of any recipe (a preset included)."""
        configs = recipe.layer_configs(self.info.num_layers)
        return self.parts_configs(configs, recipe.tensors, sequences)
