"""``kvcalib run``: generate with a recipe's compressed cache, and compare with full precision."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcalib.errors import KvcalibError
from kvcalib.models import LoadedModel, cache_kwarg
from kvcalib.recipe import Recipe
from kvcalib.runtime.sampling import Sampling


@dataclass
class GenerationResult:
    """One generation: text, tokens, speed and what the cache held at the end."""

    label: str
    text: str
    new_tokens: list[int]
    seconds: float
    kv_bytes: int
    kv_bytes_by_component: dict[str, int] = field(default_factory=dict)
    effective_bits: float = 16.0  # held bytes over elements, at the cache's real dtypes
    effective_bits_16: float = 16.0  # the recipe's accounting at 16-bit full-precision storage
    # seconds to the first new token: the prompt's prefill, and on first use the Triton kernels'
    # compilation (cached on disk by Triton: later runs skip it); None where not measured
    first_token_seconds: float | None = None
    # warm decode rate: the new tokens after the first over the time after it (nan for one token)
    decode_tokens_per_second: float = float("nan")
    prompt_tokens: int = 0
    compressed_tokens: int = 0  # tokens the cache holds quantized at the end (0: all in full precision)
    # device memory the cache's tensors occupy at the end, every byte (CompressedCache.allocated_bytes:
    # kv_bytes plus the allocations' capacity beyond the live tokens, plus the codecs' fitted tensors)
    kv_bytes_allocated: int = 0

    @property
    def tokens_per_second(self) -> float:
        return len(self.new_tokens) / self.seconds if self.seconds > 0 else float("nan")


class _TokenClock:
    """A ``model.generate`` streamer that notes when each new token arrives (and passes everything
    on to ``inner``, the text streamer, when given). transformers calls ``put`` with the prompt
    first, then once per new token."""

    def __init__(self, inner: Any, cuda: bool) -> None:
        self.inner, self.cuda, self.seen_prompt, self.times = inner, cuda, False, []

    def put(self, value: Any) -> None:
        if self.seen_prompt:
            if self.cuda:  # the token's time, not the time its kernels were queued
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
        self.seen_prompt = True
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


def _split_time(t0: float, token_times: list[float]) -> tuple[float | None, float]:
    """(seconds to the first token, warm tokens/s after it) from the arrival times."""
    if not token_times:
        return None, float("nan")
    first = token_times[0] - t0
    if len(token_times) < 2 or token_times[-1] <= token_times[0]:
        return first, float("nan")
    return first, (len(token_times) - 1) / (token_times[-1] - token_times[0])


def token_agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions (over the longer output) where both generations chose the same token."""
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    return sum(1 for x, y in zip(a, b) if x == y) / n


def _streamer(tokenizer, stream: bool):
    if not stream:
        return None
    from transformers import TextStreamer

    return TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


@torch.no_grad()
def generate(loaded: LoadedModel, prompt: str, recipe: Recipe | None, max_new_tokens: int = 64,
             stream: bool = False, cuda_graph: bool = False, sampling: Sampling | None = None) -> GenerationResult:
    """Greedy generation, or sampled when ``sampling`` is given; ``recipe=None`` uses the
    full-precision DynamicCache. ``cuda_graph``: decode steps replayed from CUDA graphs
    (:mod:`kvcalib.runtime.graphs`; compressed cache on CUDA only, no streaming: the text is
    printed at the end).

    Sampling runs ``model.generate(do_sample=True, ...)`` after ``torch.manual_seed(seed)`` (when
    a seed is given), or, with ``cuda_graph``, the graph decoder's own sampler and generator: the
    same seed repeats a run of the same path, but the two paths draw differently."""
    from transformers import DynamicCache

    from kvcalib.runtime.cache import CompressedCache

    if not prompt or not prompt.strip():
        raise KvcalibError("the prompt is empty: pass --prompt TEXT or --prompt-file FILE with some text.")
    if max_new_tokens < 1:
        raise KvcalibError(f"--max-new-tokens must be at least 1 (got {max_new_tokens}).")
    model, tok = loaded.model, loaded.tokenizer
    enc = tok(prompt, return_tensors="pt").to(next(model.parameters()).device)
    if recipe is None:
        cache: Any = DynamicCache()
        label = "full precision"
    else:
        cache = CompressedCache.from_recipe(model, recipe)
        label = recipe.name
    if cuda_graph:
        if recipe is None or not next(model.parameters()).is_cuda:
            raise KvcalibError("--cuda-graph replays decode steps of the compressed cache on a CUDA device: "
                               "run with a recipe on --device cuda, or leave --cuda-graph out.")
        from kvcalib.runtime.graphs import GraphDecoder

        t0 = time.perf_counter()
        decoder = GraphDecoder(model, cache, sampling=sampling)
        res = decoder.generate(enc["input_ids"], enc.get("attention_mask"), max_new_tokens,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        token_times: list[float] = []  # the graph decoder runs its steps without a streamer
        new = res.tokens[0].tolist()
        if tok.eos_token_id is not None and tok.eos_token_id in new:
            new = new[:new.index(tok.eos_token_id) + 1]  # as generate: up to and including the first EOS
        text = tok.decode(new, skip_special_tokens=True)
        if stream:
            print(text, flush=True)
    else:
        if sampling is None:
            decoding: dict[str, Any] = {"do_sample": False}
        else:  # top_k=0 and top_p=1.0 are passed too: they override the model's generation_config
            decoding = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
                   "top_p": sampling.top_p}
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        clock = _TokenClock(_streamer(tok, stream), next(model.parameters()).is_cuda)
        t0 = time.perf_counter()
        out = model.generate(**enc, **{cache_kwarg(model): cache}, max_new_tokens=max_new_tokens, **decoding,
                             streamer=clock, pad_token_id=tok.pad_token_id)
        if next(model.parameters()).is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        token_times = clock.times
        new = out[0, enc["input_ids"].shape[1]:].tolist()
        text = tok.decode(new, skip_special_tokens=True)
    first_s, decode_tps = _split_time(t0, token_times)
    prompt_len = int(enc["input_ids"].shape[1])
    if recipe is None:
        elem = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers if layer.keys is not None)
        size = next(iter(cache.layers)).keys.element_size()
        by = {"full_precision": int(elem * size)}
        eff, eff16 = 8.0 * elem * size / max(elem, 1), 16.0
        allocated = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                         for layer in cache.layers if layer.keys is not None
                         for t in (layer.keys, layer.values)}.values())
    else:
        by = cache.nbytes()
        eff = cache.effective_bits()
        allocated = sum(cache.allocated_bytes().values())
        length = enc["input_ids"].shape[1] + len(new) - 1
        eff16 = recipe.memory(loaded.info, max(length, 1)).effective_bits
    packed = max((layer.n_packed for layer in cache.layers if hasattr(layer, "n_packed")), default=0) \
        if recipe is not None else 0
    return GenerationResult(label, text, new, seconds, int(sum(by.values())), by, eff, eff16,
                            first_token_seconds=first_s, decode_tokens_per_second=decode_tps,
                            prompt_tokens=prompt_len, compressed_tokens=int(packed),
                            kv_bytes_allocated=int(allocated))


def too_short_note(result: GenerationResult, recipe: Recipe) -> str | None:
    """The line ``kvcalib run`` prints when nothing was compressed: the prompt and the new tokens
    fit the recipe's full-precision window (and sinks), so the run measured an uncompressed cache."""
    if result.compressed_tokens > 0:
        return None
    # a fitted recipe has one config per layer (no default_layer): the note names the longest
    # window + sinks among its compressed layers, what a prompt must pass for every layer to compress
    layers = [c for c in (recipe.layers or [recipe.default_layer]) if c is not None and c.compressed]
    if not layers:
        return None  # a full-precision recipe: nothing is ever compressed, by design
    widest = max(layers, key=lambda c: c.window + c.sinks)
    held = result.prompt_tokens + len(result.new_tokens)
    return (f"note: nothing was compressed: the {result.prompt_tokens}-token prompt and {len(result.new_tokens)} new "
            f"tokens ({held} in all) fit the recipe's full-precision window ({widest.window} tokens, {widest.sinks} "
            f"sinks, flushed in groups), so this run measured an uncompressed cache: pass a longer --prompt-file "
            f"(over {widest.window + widest.sinks} tokens) to see compression.")
