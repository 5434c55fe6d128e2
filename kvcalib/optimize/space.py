"""The search space: what the search may choose, per layer and globally.

Per layer ``i``: ``k{i}``/``v{i}`` key and value bits in ``bits`` (a subset of {2, 4, 8}), and one
on/off switch ``{method}{i}`` per method in ``layer_methods`` (a subset of the calibration methods
the runtime applies: ``clip``, ``center``, ``reorder``). Global: ``group`` (tokens per key group,
channels per value group), ``window`` (recent tokens in full precision) and ``sinks``.

Every ``window`` must be 0 or at least every ``group`` (the runtime flushes whole groups out of
the window; see :class:`~kvcalib.recipe.LayerConfig`), so any sampled pair is valid.

A space file is JSON or YAML with any subset of the keys of :class:`SearchSpace`::

    {"bits": [2, 4, 8], "groups": [32, 64], "windows": [64, 128], "sinks": [0, 4],
     "layer_methods": ["clip"]}

Unknown keys, an empty file and values outside the allowed sets are refused with a
:class:`~kvcalib.errors.KvcalibError` naming the key. Optuna is not imported here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvcalib.errors import KvcalibError
from kvcalib.recipe import LayerConfig

SEARCH_BITS = (2, 4, 8)
SEARCH_METHODS = ("center", "reorder", "clip")  # the methods the runtime applies


class SpaceError(KvcalibError, ValueError):
    """An invalid search space (a KvcalibError for the CLI, a ValueError for library code)."""


def _int_tuple(name: str, value: Any, allowed: tuple[int, ...] | None = None, low: int = 0) -> tuple[int, ...]:
    if isinstance(value, (int, str)) or not hasattr(value, "__iter__"):
        raise SpaceError(f"search space key {name!r} must be a list of integers, got {value!r}")
    out = []
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise SpaceError(f"search space key {name!r}: {v!r} is not an integer >= {low}")
        if allowed is not None and v not in allowed:
            raise SpaceError(f"search space key {name!r}: {v} is not allowed; use values in {list(allowed)}")
        out.append(v)
    if not out:
        raise SpaceError(f"search space key {name!r} is empty: give at least one value")
    return tuple(sorted(dict.fromkeys(out)))


@dataclass(frozen=True)
class SearchSpace:
    """Choices the search samples from (user configuration; validated on construction)."""

    bits: tuple[int, ...] = SEARCH_BITS  # per-layer K and V bits
    groups: tuple[int, ...] = (32, 64)
    windows: tuple[int, ...] = (64, 128)
    sinks: tuple[int, ...] = (0, 4)
    layer_methods: tuple[str, ...] = ("clip",)  # per-layer on/off switches
    k_axis: str = "channel"

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalise in place
        set_(self, "bits", _int_tuple("bits", self.bits, SEARCH_BITS))
        set_(self, "groups", _int_tuple("groups", self.groups, low=1))
        set_(self, "windows", _int_tuple("windows", self.windows, low=0))
        set_(self, "sinks", _int_tuple("sinks", self.sinks, low=0))
        if isinstance(self.layer_methods, str) or not hasattr(self.layer_methods, "__iter__"):
            raise SpaceError(f"search space key 'layer_methods' must be a list, got {self.layer_methods!r}")
        methods = tuple(dict.fromkeys(self.layer_methods))
        bad = [m for m in methods if m not in SEARCH_METHODS]
        if bad:
            raise SpaceError(f"search space key 'layer_methods': unknown method(s) {bad}; use a subset of {list(SEARCH_METHODS)}")
        set_(self, "layer_methods", tuple(m for m in SEARCH_METHODS if m in methods))
        if self.k_axis not in ("channel", "token"):
            raise SpaceError(f"search space key 'k_axis' must be 'channel' or 'token', got {self.k_axis!r}")
        short = [w for w in self.windows if w and w < max(self.groups)]
        if short:
            raise SpaceError(f"search space: windows {short} are shorter than group {max(self.groups)}; "
                             "every window must be 0 or at least every group (the runtime flushes whole groups)")

    # ------------------------------------------------------------------ files
    @classmethod
    def from_dict(cls, data: Any, where: str = "search space") -> "SearchSpace":
        if not isinstance(data, dict) or not data:
            raise SpaceError(f"{where} is empty or not a mapping: give at least one of {[f.name for f in fields(cls)]}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise SpaceError(f"{where} has unknown keys {unknown}; allowed: {sorted(allowed)}")
        return cls(**data)

    @classmethod
    def from_file(cls, path: Path | str) -> "SearchSpace":
        path = Path(path)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise SpaceError(f"cannot read search space file {path}: {err}") from None
        if not text.strip():
            raise SpaceError(f"search space file {path} is empty: give at least one of {[f.name for f in fields(cls)]}")
        try:
            if path.suffix.lower() in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as err:  # json and yaml raise different types; both are the user's file
            raise SpaceError(f"search space file {path} is not valid {'YAML' if path.suffix.lower() in ('.yaml', '.yml') else 'JSON'}: {err}") from None
        return cls.from_dict(data, f"search space file {path}")

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def fingerprint(self, num_layers: int) -> str:
        """A hash of the space and layer count: a study only continues in the same space."""
        doc = json.dumps({"space": self.to_dict(), "num_layers": num_layers}, sort_keys=True)
        return hashlib.sha256(doc.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ points
    def sample(self, trial, num_layers: int) -> "Point":
        """Ask an Optuna trial for one point (parameter names ``group``, ``k{i}``, ``clip{i}``...)."""
        group = trial.suggest_categorical("group", list(self.groups))
        window = trial.suggest_categorical("window", list(self.windows))
        sinks = trial.suggest_categorical("sinks", list(self.sinks))
        k = [trial.suggest_categorical(f"k{i}", list(self.bits)) for i in range(num_layers)]
        v = [trial.suggest_categorical(f"v{i}", list(self.bits)) for i in range(num_layers)]
        methods = [tuple(m for m in self.layer_methods if trial.suggest_categorical(f"{m}{i}", [False, True]))
                   for i in range(num_layers)]
        return Point(group, window, sinks, tuple(k), tuple(v), tuple(methods), self.k_axis)

    def floor_point(self, num_layers: int) -> "Point":
        """The cheapest point of the space: every layer at its fewest bits."""
        return Point(max(self.groups), min(self.windows), min(self.sinks), (min(self.bits),) * num_layers,
                     (min(self.bits),) * num_layers, ((),) * num_layers, self.k_axis)


@dataclass(frozen=True)
class Point:
    """One configuration of the space."""

    group: int
    window: int
    sinks: int
    k_bits: tuple[int, ...]
    v_bits: tuple[int, ...]
    methods: tuple[tuple[str, ...], ...] = field(default=())  # per layer
    k_axis: str = "channel"

    def layer_configs(self) -> list[LayerConfig]:
        return [LayerConfig(k_bits=k, v_bits=v, k_axis=self.k_axis, k_group=self.group, v_group=self.group,
                            sinks=self.sinks, window=self.window) for k, v in zip(self.k_bits, self.v_bits)]

    def params(self) -> dict[str, Any]:
        """Optuna parameters of this point (for ``study.enqueue_trial``), for ``space``."""
        out: dict[str, Any] = {"group": self.group, "window": self.window, "sinks": self.sinks}
        out.update({f"k{i}": b for i, b in enumerate(self.k_bits)})
        out.update({f"v{i}": b for i, b in enumerate(self.v_bits)})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "window": self.window, "sinks": self.sinks, "k_axis": self.k_axis,
                "k_bits": list(self.k_bits), "v_bits": list(self.v_bits),
                "methods": [list(m) for m in self.methods]}

    @classmethod
    def from_params(cls, params: dict[str, Any], space: SearchSpace, num_layers: int) -> "Point":
        """The point of a finished trial's parameters."""
        return cls(int(params["group"]), int(params["window"]), int(params["sinks"]),
                   tuple(int(params[f"k{i}"]) for i in range(num_layers)),
                   tuple(int(params[f"v{i}"]) for i in range(num_layers)),
                   tuple(tuple(m for m in space.layer_methods if params.get(f"{m}{i}")) for i in range(num_layers)),
                   space.k_axis)


def point_params(point: Point, space: SearchSpace) -> dict[str, Any]:
    """All Optuna parameters of ``point`` in ``space`` (method switches included)."""
    out = point.params()
    for i, methods in enumerate(point.methods or ((),) * len(point.k_bits)):
        for m in space.layer_methods:
            out[f"{m}{i}"] = m in methods
    return out
