"""``kvcalib collect``: run a model over calibration text and record its K/V statistics.

What is recorded is exactly what the KV cache stores: post-RoPE keys and values as the attention
layer receives them after the cache update (so GQA/MQA head counts, sliding-window layers and
per-layer scaling are whatever the model really uses). Capture goes through an attention function
registered with transformers' ``AttentionInterface`` that records, then delegates to SDPA; the
model's previous attention implementation is always restored (``try/finally``).

Padding tokens never enter the statistics: the collector passes the 2-D padding mask to the
recorder for every batch.
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from kvcalib.errors import KvcalibError
from kvcalib.models import DEFAULT_MODEL, LoadedModel, ModelInfo, model_info, rope_tables
from kvcalib.stats import CollectedStats, LayerStats, RunningChannelStats

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel

RECORD_ATTN = "kvcalib_record"


@dataclass
class CollectConfig:
    """Everything ``kvcalib collect`` needs; validated on construction."""

    model: str = DEFAULT_MODEL
    data: str = "embedded"
    split: str = "calib"
    text_field: str | None = None
    samples: int = 32
    seq_len: int = 512
    batch_size: int = 4
    reservoir_blocks: int = 8
    block_len: int = 128
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise KvcalibError(f"--samples must be at least 1 (got {self.samples}).")
        if self.seq_len < 2:
            raise KvcalibError(f"--seq-len must be at least 2 tokens (got {self.seq_len}).")
        if self.batch_size < 1:
            raise KvcalibError(f"--batch-size must be at least 1 (got {self.batch_size}).")
        if self.reservoir_blocks < 0:
            raise KvcalibError(f"--reservoir-blocks must be >= 0 (got {self.reservoir_blocks}).")
        if self.block_len < 1 or self.block_len > self.seq_len:
            raise KvcalibError(
                f"--block-len must be between 1 and --seq-len ({self.seq_len}); got {self.block_len}."
            )


class Recorder:
    """Accumulates per-layer statistics from the recording attention function."""

    def __init__(self, info: ModelInfo, reservoir_blocks: int, block_len: int, seed: int) -> None:
        self.info = info
        self.n_blocks, self.block_len = reservoir_blocks, block_len
        self.k_stats = [RunningChannelStats(info.num_kv_heads, info.head_dim) for _ in range(info.num_layers)]
        self.v_stats = [RunningChannelStats(info.num_kv_heads, info.head_dim) for _ in range(info.num_layers)]
        self.res_k: list[torch.Tensor | None] = [None] * info.num_layers  # (NB, BL, H, D)
        self.res_v: list[torch.Tensor | None] = [None] * info.num_layers  # (NB, BL, H, D)
        self.res_q: list[torch.Tensor | None] = [None] * info.num_layers  # (NB, BL, Hq, D)
        self.scaling: list[float] = [float("nan")] * info.num_layers
        self.generator = torch.Generator().manual_seed(seed)
        self.blocks_seen = 0
        self.valid: torch.Tensor | None = None  # (B, T) bool, the current batch's padding mask
        self.assignments: list[tuple[int, int, int]] = []  # (batch row, start position, slot)
        self.block_pos = torch.zeros(max(reservoir_blocks, 0), dtype=torch.int64)  # (NB,) RoPE position of each block
        self.seen_layers: set[int] = set()

    def begin_batch(self, valid: torch.Tensor) -> None:
        """Set the batch's padding mask (B, T) and decide which token blocks enter the reservoir.

        Algorithm R over blocks: the n-th block seen replaces a uniformly drawn slot with
        probability NB/n, so the reservoir is a uniform sample of all blocks whatever N is.
        """
        self.valid = valid.bool().cpu()
        self.assignments = []
        if self.n_blocks == 0:
            return
        rope_pos = self.valid.long().cumsum(-1) - 1  # (B, T): the positions the forward gives real tokens
        for row in range(self.valid.shape[0]):
            positions = torch.nonzero(self.valid[row]).flatten()
            n_full = positions.numel() // self.block_len
            for b in range(n_full):
                run = positions[b * self.block_len:(b + 1) * self.block_len]
                if run[-1] - run[0] != self.block_len - 1:  # not consecutive (holes): skip
                    continue
                if self.blocks_seen < self.n_blocks:
                    slot = self.blocks_seen
                else:
                    j = int(torch.randint(0, self.blocks_seen + 1, (1,), generator=self.generator))
                    slot = j if j < self.n_blocks else -1
                self.blocks_seen += 1
                if slot >= 0:
                    self.assignments.append((row, int(run[0]), slot))
                    self.block_pos[slot] = rope_pos[row, run[0]]

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float) -> None:
        """Record one layer's q (B, Hq, T, D), k and v (B, H, T, D) for the current batch."""
        assert self.valid is not None, "begin_batch() must run before the forward"
        self.seen_layers.add(layer)
        self.scaling[layer] = float(scaling)
        valid = self.valid.to(key.device)  # (B, T)
        if valid.shape[1] != key.shape[2]:
            raise RuntimeError(
                f"layer {layer}: the recorder expected {valid.shape[1]} key positions but got "
                f"{key.shape[2]} (collection runs without a cache; is use_cache on?)"
            )
        k_tokens = key.transpose(1, 2)[valid]  # (N, H, D)
        v_tokens = value.transpose(1, 2)[valid]  # (N, H, D)
        self.k_stats[layer].update(k_tokens)
        self.v_stats[layer].update(v_tokens)
        if self.n_blocks == 0:
            return
        if self.res_k[layer] is None:
            h, d, hq = key.shape[1], key.shape[3], query.shape[1]
            self.res_k[layer] = torch.zeros(self.n_blocks, self.block_len, h, d, dtype=torch.float16)
            self.res_v[layer] = torch.zeros(self.n_blocks, self.block_len, h, d, dtype=torch.float16)
            self.res_q[layer] = torch.zeros(self.n_blocks, self.block_len, hq, d, dtype=torch.float16)
        for row, start, slot in self.assignments:
            span = slice(start, start + self.block_len)
            self.res_k[layer][slot] = key[row, :, span].transpose(0, 1).to(torch.float16).cpu()
            self.res_v[layer][slot] = value[row, :, span].transpose(0, 1).to(torch.float16).cpu()
            self.res_q[layer][slot] = query[row, :, span].transpose(0, 1).to(torch.float16).cpu()

    def result(self, config: dict[str, Any], rope: list[torch.Tensor | None] | None = None) -> CollectedStats:
        """The statistics; ``rope``: each layer's rotary table (:func:`kvcalib.models.rope_tables`)."""
        missing = sorted(set(range(self.info.num_layers)) - self.seen_layers)
        if missing:
            raise RuntimeError(f"layers {missing} were never observed: the model's attention did not go through the recorder")
        filled = min(self.blocks_seen, self.n_blocks)
        layers = []
        for i in range(self.info.num_layers):
            h, d = self.info.num_kv_heads, self.info.head_dim
            empty = torch.zeros(0, self.block_len, h, d, dtype=torch.float16)
            res_k = self.res_k[i][:filled] if self.res_k[i] is not None else empty
            res_v = self.res_v[i][:filled] if self.res_v[i] is not None else empty
            res_q = (self.res_q[i][:filled] if self.res_q[i] is not None
                     else torch.zeros(0, self.block_len, self.info.num_q_heads, d, dtype=torch.float16))
            layers.append(LayerStats(
                k=self.k_stats[i].tensors(), v=self.v_stats[i].tensors(),
                reservoir_k=res_k, reservoir_v=res_v, reservoir_q=res_q, scaling=self.scaling[i],
                rope=None if rope is None else rope[i], positions=self.block_pos[:filled].clone(),
            ))
        return CollectedStats(model=self.info, layers=layers, config=config, filled_blocks=filled)


_ACTIVE_RECORDER: Recorder | None = None


def _record_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function: record q/k/v of ``module.layer_idx``, then run SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _ACTIVE_RECORDER is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        _ACTIVE_RECORDER.observe(int(module.layer_idx), query, key, value, scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                  dropout=dropout, **kwargs)


def _register_record_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(RECORD_ATTN, _record_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(RECORD_ATTN, sdpa_mask)


@contextlib.contextmanager
def recording(model: "PreTrainedModel", recorder: Recorder) -> Iterator[Recorder]:
    """Route ``model``'s attention through the recorder; always restore it afterwards."""
    global _ACTIVE_RECORDER
    _register_record_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(RECORD_ATTN)
    _ACTIVE_RECORDER = recorder
    try:
        yield recorder
    finally:
        _ACTIVE_RECORDER = None
        model.set_attn_implementation(previous)


def left_pad(sequences: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D token tensors into ``input_ids`` (B, T) and ``attention_mask`` (B, T)."""
    width = max(int(s.numel()) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)  # (B, T)
    for row, seq in enumerate(sequences):
        n = int(seq.numel())
        ids[row, width - n:] = seq
        mask[row, width - n:] = 1
    return ids, mask


@torch.no_grad()
def collect_stats(
    model: "PreTrainedModel",
    samples: list[torch.Tensor] | torch.Tensor,
    *,
    pad_id: int = 0,
    batch_size: int = 4,
    reservoir_blocks: int = 8,
    block_len: int = 128,
    seed: int = 0,
    name: str = "model",
    config: dict[str, Any] | None = None,
    progress: bool = True,
) -> CollectedStats:
    """Run ``model`` over ``samples`` (1-D token tensors, any lengths) and return the statistics.

    Batches are left-padded; padding never enters the statistics or the reservoir.
    """
    from kvcalib.progress import ProgressBar

    seqs = [s for s in samples] if isinstance(samples, torch.Tensor) else list(samples)
    if not seqs:
        raise KvcalibError("no calibration samples: the dataset gave no text; pass a non-empty --data.")
    info = model_info(model.config, name)
    recorder = Recorder(info, reservoir_blocks, min(block_len, max(int(s.numel()) for s in seqs)), seed)
    device = next(model.parameters()).device
    body = getattr(model, "model", model)  # skip the LM head: logits are not needed here
    bar_cm = ProgressBar(len(seqs), "collect", "samples") if progress else contextlib.nullcontext()
    with recording(model, recorder), bar_cm as bar:
        for start in range(0, len(seqs), batch_size):
            chunk = seqs[start:start + batch_size]
            ids, mask = left_pad(chunk, pad_id)  # (B, T), (B, T)
            recorder.begin_batch(mask.bool())
            # positions count real tokens only, as generate() does, so RoPE matches an unpadded run
            positions = (mask.cumsum(-1) - 1).clamp_min(0)  # (B, T)
            body(input_ids=ids.to(device), attention_mask=mask.to(device),
                 position_ids=positions.to(device), use_cache=False)
            if bar is not None:
                bar.advance(len(chunk))
    return recorder.result(config or {}, rope_tables(model))


def library_versions() -> dict[str, str]:
    """Versions of the libraries that decide what was computed."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("kvcalib", "torch", "transformers", "safetensors", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


@dataclass
class CollectResult:
    """What ``collect`` wrote, and a per-layer summary for people."""

    out_dir: Path
    stats: CollectedStats
    wall_seconds: float
    n_samples: int
    n_tokens: int
    summary: list[dict[str, float]] = field(default_factory=list)


def layer_summary(stats: CollectedStats) -> list[dict[str, float]]:
    """Per layer: largest |key| and |value|, and the key channel spread (max absmax / median)."""
    rows = []
    for i, layer in enumerate(stats.layers):
        k_abs = layer.k["absmax"]  # (H, D)
        rows.append({
            "layer": i,
            "k_absmax": float(k_abs.max()),
            "k_outlier_ratio": float(k_abs.max() / k_abs.median().clamp_min(1e-12)),
            "v_absmax": float(layer.v["absmax"].max()),
            "k_std": float((layer.k["sq_mean"] - layer.k["mean"] ** 2).clamp_min(0).sqrt().mean()),
            "v_std": float((layer.v["sq_mean"] - layer.v["mean"] ** 2).clamp_min(0).sqrt().mean()),
        })
    return rows


def prepare_out_dir(out: Path) -> None:
    """Refuse an existing non-empty folder or an unwritable place before any work starts."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KvcalibError(f"--out {out} already exists and is not empty: pass a new folder (run folders are never overwritten).")
    parent = out.parent if not out.exists() else out
    probe_dir = parent
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    import os

    if not os.access(probe_dir, os.W_OK):
        raise KvcalibError(f"cannot write to {probe_dir}: pass an --out folder in a place you can write.")


def collect(config: CollectConfig, out_dir: Path, *, loaded: LoadedModel | None = None) -> CollectResult:
    """The whole ``kvcalib collect`` job: load, pack text, record, write ``stats.safetensors``
    and ``run.json`` into ``out_dir`` atomically (a temporary folder renamed at the end)."""
    from kvcalib.data import load_texts, pack_samples
    from kvcalib.io import atomic_path
    from kvcalib.models import load_model

    out_dir = Path(out_dir)
    prepare_out_dir(out_dir)
    t0 = time.perf_counter()
    loaded = loaded or load_model(config.model, device=config.device, dtype=config.dtype,
                                  trust_remote_code=config.trust_remote_code)
    if loaded.info.max_positions and config.seq_len > loaded.info.max_positions:
        raise KvcalibError(
            f"--seq-len {config.seq_len} is over {loaded.info.name}'s maximum of "
            f"{loaded.info.max_positions} positions: pass --seq-len {loaded.info.max_positions} or less."
        )
    texts = load_texts(config.data, split=config.split, text_field=config.text_field)
    samples = pack_samples(texts, loaded.tokenizer, config.seq_len, config.samples, seed=config.seed)
    resolved = asdict(config)
    stats = collect_stats(
        loaded.model, list(samples), pad_id=int(loaded.tokenizer.pad_token_id or 0),
        batch_size=config.batch_size, reservoir_blocks=config.reservoir_blocks,
        block_len=config.block_len, seed=config.seed, name=loaded.info.name, config=resolved,
    )
    wall = time.perf_counter() - t0
    n_tokens = int(samples.numel())
    run = {
        "command": "collect",
        "config": resolved,
        "seed": config.seed,
        "model": loaded.info.to_dict(),
        "model_source": loaded.resolved,
        "samples_packed": int(samples.shape[0]),
        "tokens": n_tokens,
        "reservoir_blocks_filled": stats.filled_blocks,
        "versions": library_versions(),
        "wall_seconds": round(wall, 2),
    }
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked above); recreated by the rename
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        stats.save(tmp / "stats.safetensors")
        (tmp / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    return CollectResult(out_dir, stats, wall, int(samples.shape[0]), n_tokens, layer_summary(stats))
