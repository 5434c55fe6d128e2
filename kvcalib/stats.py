"""Streaming K/V statistics and a bounded reservoir of token blocks: ``stats.safetensors``.

Memory stays bounded whatever the number of samples: per layer and K|V we keep running
per-(kv-head, channel) moments (Chan et al.'s parallel update, in float64), and a reservoir of
``n_blocks`` blocks of ``block_len`` *consecutive* tokens (keys are quantized per channel over
groups of consecutive tokens, so calibration needs real consecutive runs, not scattered tokens).
The reservoir also keeps the queries of those tokens, so calibration can score the error of the
attention output rather than only of the raw values.

File layout (safetensors, no pickle)::

    layers.{i}.{k|v}.count     ()        int64   tokens seen
    layers.{i}.{k|v}.min       (H, D)    float32
    layers.{i}.{k|v}.max       (H, D)    float32
    layers.{i}.{k|v}.mean      (H, D)    float32
    layers.{i}.{k|v}.absmax    (H, D)    float32
    layers.{i}.{k|v}.sq_mean   (H, D)    float32  E[x^2] (second moment)
    layers.{i}.reservoir.k     (NB, BL, H, D)   float16
    layers.{i}.reservoir.v     (NB, BL, H, D)   float16
    layers.{i}.reservoir.q     (NB, BL, Hq, D)  float16
    layers.{i}.rope            (R/2 + 1,) float32 the layer's rotary embedding: inverse frequencies
                                                 of its R rotated channels, then the attention
                                                 scaling of cos/sin (optional: absent for a model
                                                 without a static RoPE, and in older files)
    reservoir.filled           ()        int64   blocks actually filled (<= NB)
    reservoir.positions        (NB,)     int64   RoPE position of each block's first token
                                                 (optional: absent in older files)

Metadata: ``format`` = ``kvcalib-stats``, ``version``, ``model`` (ModelInfo JSON), ``scaling``
(per-layer softmax scale JSON), ``config`` (collection config JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcalib.errors import KvcalibError
from kvcalib.models import ModelInfo

STATS_FORMAT = "kvcalib-stats"
STATS_VERSION = 1


class RunningChannelStats:
    """Per-(head, channel) streaming min/max/mean/variance/second moment of vectors (N, H, D)."""

    def __init__(self, heads: int, dim: int) -> None:
        self.count = 0
        self.min = torch.full((heads, dim), float("inf"), dtype=torch.float64)  # (H, D)
        self.max = torch.full((heads, dim), float("-inf"), dtype=torch.float64)  # (H, D)
        self.mean = torch.zeros((heads, dim), dtype=torch.float64)  # (H, D)
        self.m2 = torch.zeros((heads, dim), dtype=torch.float64)  # (H, D) sum of squared deviations

    def update(self, x: torch.Tensor) -> None:
        """Fold in ``x`` (N, H, D) of valid tokens (padding already removed)."""
        n_b = x.shape[0]
        if n_b == 0:
            return
        x = x.detach().to(torch.float64)
        if not torch.isfinite(x).all():
            raise KvcalibError(
                "the model produced NaN or inf in its keys/values during collection: load it in "
                "fp32 (--dtype fp32) or check the model weights."
            )
        self.min = torch.minimum(self.min, x.amin(0).cpu())
        self.max = torch.maximum(self.max, x.amax(0).cpu())
        mean_b = x.mean(0).cpu()  # (H, D)
        m2_b = ((x - x.mean(0)) ** 2).sum(0).cpu()  # (H, D)
        n_a = self.count
        n = n_a + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + delta**2 * (n_a * n_b / n)
        self.count = n

    def tensors(self) -> dict[str, torch.Tensor]:
        """count () and min/max/mean/absmax/sq_mean (H, D) as float32."""
        var = self.m2 / max(self.count, 1)
        return {
            "count": torch.tensor(self.count, dtype=torch.int64),
            "min": self.min.float(),
            "max": self.max.float(),
            "mean": self.mean.float(),
            "absmax": torch.maximum(self.min.abs(), self.max.abs()).float(),
            "sq_mean": (var + self.mean**2).float(),
        }


@dataclass
class LayerStats:
    """What calibration reads for one layer (shapes in the module docstring)."""

    k: dict[str, torch.Tensor]  # min/max/mean/absmax/sq_mean (H, D), count ()
    v: dict[str, torch.Tensor]
    reservoir_k: torch.Tensor  # (NB, BL, H, D)
    reservoir_v: torch.Tensor  # (NB, BL, H, D)
    reservoir_q: torch.Tensor  # (NB, BL, Hq, D)
    scaling: float  # softmax scale the model applies to q.k
    rope: torch.Tensor | None = None  # (R/2 + 1,) float32: inv_freq of the rotated channels, then the cos/sin scaling
    positions: torch.Tensor | None = None  # (NB,) int64: RoPE position of each reservoir block's first token


@dataclass
class CollectedStats:
    """All layers' statistics plus the model they came from."""

    model: ModelInfo
    layers: list[LayerStats]
    config: dict[str, Any] = field(default_factory=dict)
    filled_blocks: int = 0

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        from kvcalib.io import atomic_path

        tensors: dict[str, torch.Tensor] = {"reservoir.filled": torch.tensor(self.filled_blocks)}
        for i, layer in enumerate(self.layers):
            for kind in ("k", "v"):
                for key, val in getattr(layer, kind).items():
                    tensors[f"layers.{i}.{kind}.{key}"] = val.contiguous()
            tensors[f"layers.{i}.reservoir.k"] = layer.reservoir_k.contiguous()
            tensors[f"layers.{i}.reservoir.v"] = layer.reservoir_v.contiguous()
            tensors[f"layers.{i}.reservoir.q"] = layer.reservoir_q.contiguous()
            if layer.rope is not None:
                tensors[f"layers.{i}.rope"] = layer.rope.float().contiguous()
        first = self.layers[0] if self.layers else None
        if first is not None and first.positions is not None:
            tensors["reservoir.positions"] = first.positions.long().contiguous()
        metadata = {
            "format": STATS_FORMAT,
            "version": str(STATS_VERSION),
            "model": json.dumps(self.model.to_dict()),
            "scaling": json.dumps([layer.scaling for layer in self.layers]),
            "config": json.dumps(self.config),
        }
        with atomic_path(Path(path)) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)

    @classmethod
    def load(cls, path: Path) -> "CollectedStats":
        from safetensors import safe_open

        path = Path(path)
        if path.is_dir():
            path = path / "stats.safetensors"
        if not path.is_file():
            raise KvcalibError(f"no statistics at {path}: run `kvcalib collect --out RUN_DIR` first and pass that RUN_DIR.")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != STATS_FORMAT:
                    raise KvcalibError(f"{path} is not a kvcalib statistics file (format {meta.get('format')!r}): pass the stats.safetensors written by `kvcalib collect`.")
                if meta.get("version") != str(STATS_VERSION):
                    raise KvcalibError(f"{path} has statistics version {meta.get('version')}, this kvcalib reads {STATS_VERSION}: collect again.")
                model = ModelInfo.from_dict(json.loads(meta["model"]))
                scaling = json.loads(meta["scaling"])
                names = set(f.keys())
                positions = f.get_tensor("reservoir.positions") if "reservoir.positions" in names else None
                layers = []
                for i in range(model.num_layers):
                    def group(kind: str) -> dict[str, torch.Tensor]:
                        return {key: f.get_tensor(f"layers.{i}.{kind}.{key}")
                                for key in ("count", "min", "max", "mean", "absmax", "sq_mean")}
                    layers.append(LayerStats(
                        k=group("k"), v=group("v"),
                        reservoir_k=f.get_tensor(f"layers.{i}.reservoir.k"),
                        reservoir_v=f.get_tensor(f"layers.{i}.reservoir.v"),
                        reservoir_q=f.get_tensor(f"layers.{i}.reservoir.q"),
                        scaling=float(scaling[i]),
                        rope=f.get_tensor(f"layers.{i}.rope") if f"layers.{i}.rope" in names else None,
                        positions=positions,
                    ))
                filled = int(f.get_tensor("reservoir.filled"))
                config = json.loads(meta.get("config", "{}"))
        except KvcalibError:
            raise
        except Exception as err:  # safetensors raises several types for corrupt files
            raise KvcalibError(f"{path} is corrupt or truncated ({type(err).__name__}): collect the statistics again.") from None
        return cls(model=model, layers=layers, config=config, filled_blocks=filled)
