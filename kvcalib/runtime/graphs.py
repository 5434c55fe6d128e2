"""Decoding (greedy, or sampled) with each step replayed from a CUDA graph.

An eager decode step of a 7B model launches hundreds of small kernels from Python; at batch 8
and 32k context the step is bound by that host work, not by the GPU (``artifacts/bench/e2e.md``).
:class:`GraphDecoder` captures one whole step (model forward, cache write, fused attention,
next-token pick) into a CUDA graph and replays it, so a step costs one launch.

Static shapes per bucket: a :class:`~kvcalib.runtime.cache.CompressedCache` in static mode
(:mod:`kvcalib.runtime.static`) keeps its pending window in a fixed buffer and reads the step's
position from the device, so every step between two flushes launches the same kernels on the
same buffers. A flush (every ``flush_block`` steps) changes the packed store, and so does a
block moving down a PATS tier (:meth:`~kvcalib.runtime.cache.CompressedLayer.flush_due` counts
both), so the driver flushes eagerly between steps and captures the next period's graph: one
eager step (which also compiles what is new) and one capture per period (``flush_block`` steps,
fewer when tier moves fall between flushes), replays otherwise.

A transformers ``StaticCache`` (the bf16 baseline of the benchmark) works too: it has no
flushes, so one capture serves every step; its attention gets a 4D visibility mask refreshed on
the device.

``capture=False`` runs exactly the same step eagerly, on the current stream (the CPU tests, and
the check that a graph changes nothing; only a step warming up a capture runs on a side stream,
as capture asks). A static step launches what a dynamic decode step launches
(:mod:`kvcalib.runtime.cache`), so graph decoding and ``model.generate`` over the cache make one
computation. Padded batches decode each row as its prompt alone (each row flushing at its own
steps; one kernel launch for all rows where they join, :mod:`kvcalib.runtime.joint`, one per row
otherwise). EOS ends a sequence (it then repeats ``pad_token_id``).

The pick is greedy (argmax) by default; ``sampling=Sampling(...)``
(:mod:`kvcalib.runtime.sampling`) samples inside the captured step instead: temperature, top-k,
top-p and a Gumbel-max draw, all on the device. The noise comes from the decoder's own
``torch.Generator``, seeded once from ``Sampling.seed`` and registered with every captured graph
(``CUDAGraph.register_generator_state``): a replay then draws exactly what the same step run
eagerly would, so ``capture=True`` and ``capture=False`` give the same tokens for the same seed.
On a torch without that method only the default CUDA generator works under capture: it is used
(and seeded with ``seed``, which touches the global CUDA RNG) instead.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch

from kvcalib.errors import KvcalibError
from kvcalib.models import cache_from, cache_kwarg
from kvcalib.runtime.sampling import Sampling, make_generator, sample


@dataclass
class DecodeResult:
    """Tokens chosen per step (B, steps) and, when asked, the logits of each step."""

    tokens: torch.Tensor  # (B, steps) int64
    logits: list[torch.Tensor] = field(default_factory=list)  # steps x (B, V) float32
    captures: int = 0  # CUDA graphs captured (one per flush period with a CompressedCache)
    replays: int = 0  # steps replayed from a graph
    eager_steps: int = 0  # steps run eagerly (first of each period, or capture=False)


def _takes(model, name: str) -> bool:
    """Whether the model's forward takes ``name`` (``cache_position`` left transformers in 5.x)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _graph_generator(device: torch.device, seed: int | None) -> tuple[torch.Generator, bool]:
    """The sampling generator for ``device`` and whether it must be registered with each graph.

    A dedicated generator needs ``CUDAGraph.register_generator_state`` (torch >= 2.4) to be
    usable under capture; without it only the device's default generator is, so that one is
    seeded (when ``seed`` is given) and used."""
    if device.type != "cuda" or hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
        return make_generator(device, seed), device.type == "cuda"
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    if seed is not None:
        generator.manual_seed(seed)
    return generator, False  # the default generator is registered by the capture itself


class GraphDecoder:
    """Decode steps over ``cache`` (a CompressedCache or a transformers StaticCache), greedy
    unless ``sampling`` says how to sample (:class:`~kvcalib.runtime.sampling.Sampling`)."""

    def __init__(self, model, cache, *, capture: bool = True, keep_logits: bool = False,
                 sampling: Sampling | None = None) -> None:
        from kvcalib.accel import requested_backend
        from kvcalib.runtime.cache import CompressedCache

        if isinstance(cache, CompressedCache) and requested_backend() == "reference":
            raise KvcalibError("KVCALIB_BACKEND=reference cannot run static (CUDA-graph) decode steps, which need "
                               "the fused kernel: unset it, or decode without CUDA graphs")
        self.model = model
        self.cache = cache
        self._cache_kw = cache_kwarg(model)  # `cache` on transformers 5.2x+, else `past_key_values`
        self.compressed = isinstance(cache, CompressedCache)
        self.device = next(model.parameters()).device
        if capture and self.device.type != "cuda":
            raise KvcalibError("CUDA graphs need a CUDA model: decode eagerly (capture=False) on this device")
        self.capture = capture
        self.keep_logits = keep_logits
        if sampling is not None and not isinstance(sampling, Sampling):
            raise KvcalibError(f"sampling must be a kvcalib.runtime.sampling.Sampling or None for greedy decoding "
                               f"(got {type(sampling).__name__}).")
        self.sampling = sampling
        # one generator per decoder, seeded once: successive steps (and generate calls) continue its stream
        self.generator, self._register_generator = (None, False) if sampling is None else \
            _graph_generator(self.device, sampling.seed)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._pool = None  # memory pool of this decode call's graphs (shared by its periods)
        self._retired = None  # the last period's graph, alive until the next capture (see _capture)
        self._with_cache_position = _takes(model, "cache_position")
        self._mask4d: torch.Tensor | None = None  # StaticCache: (B, 1, 1, max_len) bool
        self._positions: torch.Tensor | None = None  # StaticCache: (1, 1, 1, max_len) int64

    # ------------------------------------------------------------------ one step
    def _forward_step(self) -> None:
        """The captured body: refresh the visibility, run the model on ``tok``, pick the next token."""
        extra = {}
        if self.compressed:
            self.state.refresh()
        else:
            torch.le(self._positions, self.position, out=self._mask4d)
            extra["attention_mask"] = self._mask4d
        if self._with_cache_position:
            extra["cache_position"] = self.position
        out = self.model(input_ids=self.tok, position_ids=self.position_ids, **{self._cache_kw: self.cache},
                         use_cache=True, logits_to_keep=1, **extra)
        self._pick(out.logits[:, -1].float())

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Next tokens (B, 1) int64 from ``logits`` (B, V): argmax, or sampled (no host sync either way)."""
        if self.sampling is None:
            return logits.argmax(-1, keepdim=True)  # (B, 1)
        return sample(logits, self.sampling, self.generator)  # (B, 1)

    def _pick(self, logits: torch.Tensor) -> None:
        """Choose from ``logits`` (B, V) (kept raw); advance the positions (all on the device)."""
        self.logits.copy_(logits)
        nxt = self._choose(logits)  # (B, 1)
        if self.eos is not None:
            nxt = torch.where(self.done, torch.full_like(nxt, self.pad), nxt)
            self.done |= torch.isin(nxt, self.eos)
        self.tok.copy_(nxt)
        self.position.add_(1)
        self.position_ids.add_(1)

    def _eager_step(self) -> None:
        if self.device.type == "cuda" and self.capture:  # warm up off the capture stream, as capture asks
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward_step()
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            self._forward_step()

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        if self._register_generator:  # before the capture begins, as torch requires
            graph.register_generator_state(self.generator)
        # a shared pool is only valid while a graph that uses it is alive (torch asserts
        # use_count > 0 otherwise): the retired graph keeps it so until this capture holds it too
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward_step()
        self._pool = graph.pool()
        self._graph = graph
        self._retired = None

    def _retire(self) -> None:
        """End the period's graph. The last graph captured stays alive until the next capture (its
        pool with it, see :meth:`_capture`), also across periods that captured nothing: rows of a
        padded batch flush at different steps, and a flush right after a period's eager step once
        dropped it, which freed the pool under ``self._pool`` (torch's assert ``use_count > 0`` at
        the next capture, H100)."""
        if self._graph is not None:
            self._retired = self._graph
        self._graph = None

    def _enter_period(self) -> None:
        """(Re)build the static state: after the prompt and after every flush."""
        if self.compressed:
            self.state = self.cache.make_static(self.position)
        elif self._mask4d is None:
            max_len = int(self.cache.layers[0].max_cache_len)
            self._positions = torch.arange(max_len, device=self.device).view(1, 1, 1, max_len)  # (1, 1, 1, L)
            self._mask4d = torch.zeros((1, 1, 1, max_len), dtype=torch.bool, device=self.device)  # (1, 1, 1, L)

    def _static_ready(self) -> bool:
        """Whether the compressed cache can enter static mode now; False while the prompt has not
        filled the sinks yet (those steps run dynamically); raises for layers that never can."""
        blockers = self.cache.static_blockers()
        if not blockers:
            return True
        if all(layer.waiting_for_tokens() for layer in self.cache.layers if layer.static_blocker() is not None):
            return False
        raise KvcalibError("CUDA-graph decoding needs every layer on the fused kernel: " + "; ".join(blockers)
                           + ". Decode without CUDA graphs for this recipe.")

    def _dynamic_step(self) -> None:
        """A step over the cache in its ordinary (dynamic) mode, e.g. while the sinks fill."""
        valid = self.cache.padding_mask()  # (B, n_seen) bool or None
        mask = None if valid is None else torch.cat([valid, valid.new_ones((valid.shape[0], 1))], 1).long()
        out = self.model(input_ids=self.tok, position_ids=self.position_ids, **{self._cache_kw: self.cache},
                         use_cache=True, logits_to_keep=1, attention_mask=mask)
        self._pick(out.logits[:, -1].float())

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def decode(self, first_token: torch.Tensor, position: int, position_ids: torch.Tensor, steps: int,
               eos_token_id=None, pad_token_id: int | None = None, step_times: list | None = None) -> DecodeResult:
        """Feed ``first_token`` (B, 1) at absolute cache position ``position`` (rotary positions
        ``position_ids`` (B, 1)) and decode ``steps`` tokens (greedily, or as ``sampling`` says).

        ``step_times``: when a list, each step's wall time (seconds, synchronised) is appended.
        """
        import time

        b = first_token.shape[0]
        dev = self.device
        self.tok = first_token.to(dev, torch.long).reshape(b, 1).clone()  # (B, 1)
        self.position = torch.tensor([position], dtype=torch.long, device=dev)  # (1,)
        self.position_ids = position_ids.to(dev, torch.long).reshape(b, 1).clone()  # (B, 1)
        self.logits = torch.empty((b, self.model.config.get_text_config().vocab_size), dtype=torch.float32,
                                  device=dev)  # (B, V)
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        self.eos = torch.tensor(eos, dtype=torch.long, device=dev) if eos else None
        self.pad = int(pad_token_id if pad_token_id is not None else (eos[0] if eos else 0))
        self.done = (torch.isin(self.tok, self.eos) if self.eos is not None
                     else torch.zeros((b, 1), dtype=torch.bool, device=dev))  # (B, 1)
        tokens = torch.empty((b, steps), dtype=torch.long, device=dev)  # (B, steps)
        res = DecodeResult(tokens)
        self._graph = None
        sync = dev.type == "cuda" and step_times is not None
        try:
            for i in range(steps):
                if sync:
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                static = True
                if self._graph is not None:
                    self._graph.replay()
                    res.replays += 1
                elif self.compressed and not self._static_ready():
                    self._dynamic_step()
                    res.eager_steps += 1
                    static = False
                else:
                    self._enter_period()
                    self._eager_step()
                    res.eager_steps += 1
                if self.compressed and static:
                    self.cache.advance_static()
                tokens[:, i] = self.tok[:, 0]
                if self.keep_logits:
                    res.logits.append(self.logits.clone())
                if self.compressed and static and self.cache.flush_due():
                    self.cache.flush()  # the packed store changes: the next step starts a new period
                    self._retire()
                elif static and self._graph is None and self.capture and i + 1 < steps:
                    self._capture()
                    res.captures += 1
                if sync:
                    torch.cuda.synchronize(dev)
                if step_times is not None:
                    step_times.append(time.perf_counter() - t0)
                if self.eos is not None and (i + 1) % 16 == 0 and bool(self.done.all()):
                    res.tokens = tokens[:, :i + 1]
                    break
        finally:
            self._graph = self._retired = None
            self._pool = None  # its graphs are gone: the next call captures into a fresh pool
            if self.compressed:
                self.cache.make_dynamic()
        return res

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 64, eos_token_id=None, pad_token_id: int | None = None) -> DecodeResult:
        """Prefill ``input_ids`` (B, T) eagerly (left padding through ``attention_mask``), then
        decode ``max_new_tokens`` tokens; the first comes from the prefill's logits, picked the
        same way as the others."""
        if max_new_tokens < 1:
            raise KvcalibError(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
        dev = self.device
        input_ids = input_ids.to(dev)
        b, t = input_ids.shape
        if attention_mask is None:
            position_ids = torch.arange(t, device=dev)[None].expand(b, t)  # (B, T)
        else:
            attention_mask = attention_mask.to(dev)
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, T)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         **{self._cache_kw: self.cache}, use_cache=True, logits_to_keep=1)
        first_logits = out.logits[:, -1].float()  # (B, V)
        first = self._choose(first_logits)  # (B, 1) int64
        res = self.decode(first, t, position_ids[:, -1:] + 1, max_new_tokens - 1, eos_token_id, pad_token_id)
        res.tokens = torch.cat([first, res.tokens], dim=1)
        if self.keep_logits:
            res.logits.insert(0, first_logits)
        return res


class _GenerateSteps(GraphDecoder):
    """The decode steps of a plain ``model.generate`` replayed from CUDA graphs (:func:`cuda_graphs`).

    ``generate`` keeps choosing tokens (greedy, sampling, logits processors, stopping criteria:
    all of it outside the graph); each decode step it makes -- one token per row over a
    CompressedCache -- copies its token and rotary positions into the static buffers, replays the
    period's graph (model forward, cache write, fused attention; no pick) and hands back the
    logits. The period protocol is GraphDecoder's: the first step after the prompt or a flush runs
    the same static body eagerly (compiling what is new), the next is captured, then replayed; a
    flush between steps starts a new period. Steps the static mode cannot take yet (the prompt
    has not filled the sinks) run the model as it is."""

    def __init__(self, model, cache, *, capture: bool = True) -> None:
        super().__init__(model, cache, capture=capture)
        self.busy = False  # inside a step: the model's own forward runs, not this one
        self.state = None

    def _forward_step(self) -> None:
        self.state.refresh()
        extra = {"cache_position": self.position} if self._with_cache_position else {}
        out = self.model(input_ids=self.tok, position_ids=self.position_ids, **{self._cache_kw: self.cache},
                         use_cache=True, logits_to_keep=1, **extra)
        self.logits.copy_(out.logits[:, -1])

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None):
        """One ``generate`` decode step: ``input_ids`` (B, 1), rotary ``position_ids`` (B, 1) or
        None (the cache position); returns the model output, or None when the static mode cannot
        take this step yet (the caller runs the model as it is)."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        cache = self.cache
        b = input_ids.shape[0]
        n = cache.layers[0].n_seen  # the new token's absolute cache position
        if position_ids is None:
            position_ids = torch.full((b, 1), n, dtype=torch.long, device=input_ids.device)
        if self._graph is None and not self._static_ready():
            return None
        if getattr(self, "tok", None) is None or self.tok.shape[0] != b:
            dev = self.device
            self.tok = torch.empty((b, 1), dtype=torch.long, device=dev)  # (B, 1)
            self.position_ids = torch.empty((b, 1), dtype=torch.long, device=dev)  # (B, 1)
            self.position = torch.empty((1,), dtype=torch.long, device=dev)  # (1,)
            vocab = self.model.config.get_text_config().vocab_size
            self.logits = torch.empty((b, vocab), dtype=next(self.model.parameters()).dtype, device=dev)  # (B, V)
        self.tok.copy_(input_ids)
        self.position_ids.copy_(position_ids)
        self.position.fill_(n)
        if self._graph is not None:
            self._graph.replay()
        else:
            self._enter_period()
            self._eager_step()
        cache.advance_static()
        logits = self.logits.clone()[:, None]  # (B, 1, V): the buffer is rewritten by the next step
        if cache.flush_due():
            cache.flush()  # the packed store changes: the next step starts a new period
            self._retire()
        elif self._graph is None and self.capture:
            self._capture()
        # the output's cache field is `cache` on transformers 5.2x+ (`past_key_values` before)
        field_name = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
        return CausalLMOutputWithPast(logits=logits, **{field_name: cache})

    def close(self) -> None:
        self._graph = self._retired = None
        self._pool = None
        if self.state is not None:
            self.cache.make_dynamic()
            self.state = None


@contextlib.contextmanager
def cuda_graphs(model, *, capture: bool = True):
    """Within the block, ``model.generate(..., past_key_values=CompressedCache)`` (or ``cache=``, the
    keyword of transformers 5.2x+) replays every
    decode step from a CUDA graph: the one-liner for graph decoding in the generate call you
    already use (sampling, logits processors and stopping criteria stay generate's own)::

        cache = kvcalib.CompressedCache.from_recipe(model, "kivi-2")
        with kvcalib.cuda_graphs(model):
            out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)

    Steps that are not single-token decode steps over a CompressedCache on the kernel (the
    prompt, other caches, a layer the kernel does not cover raises as GraphDecoder does) run the
    model as it is. The model's forward is wrapped for the block only (on the instance; restored
    on exit, also after an error). ``capture=False`` runs the same static steps without graphs
    (CPU tests under the Triton interpreter). A model off CUDA is left as it is, with a warning:
    generate inside the block then runs eagerly."""
    from kvcalib.runtime.cache import CompressedCache

    import functools

    if capture and next(model.parameters()).device.type != "cuda":
        # the same code runs on a laptop and on the GPU server: off CUDA there is nothing to replay,
        # and generate inside the block is generate
        import warnings

        warnings.warn("kvcalib.cuda_graphs: the model is not on a CUDA device, so generate runs as it is "
                      "(no CUDA graphs)", stacklevel=3)
        yield model
        return
    original = model.forward
    steppers: dict[int, _GenerateSteps] = {}

    @functools.wraps(original)  # generate reads the forward's signature (position_ids from the mask)
    def forward(*args, **kwargs):
        cache = cache_from(kwargs)  # generate passes it as `cache` on transformers 5.2x+
        ids = kwargs.get("input_ids", args[0] if args else None)
        stepper = steppers.get(id(cache))
        eligible = (isinstance(cache, CompressedCache) and ids is not None and ids.dim() == 2 and ids.shape[1] == 1
                    and kwargs.get("inputs_embeds") is None and not kwargs.get("output_attentions")
                    and not kwargs.get("output_hidden_states"))
        if not eligible or (stepper is not None and stepper.busy):
            return original(*args, **kwargs)
        if stepper is None:
            for old in steppers.values():  # a new cache: the last generate call is over
                old.close()
            steppers.clear()
            stepper = steppers[id(cache)] = _GenerateSteps(model, cache, capture=capture)
        stepper.busy = True
        try:
            out = stepper.step(ids, kwargs.get("position_ids"))
        finally:
            stepper.busy = False
        return original(*args, **kwargs) if out is None else out

    model.forward = forward
    try:
        yield model
    finally:
        for stepper in steppers.values():
            stepper.close()
        if model.__dict__.get("forward") is forward:
            del model.forward  # the class's forward again
