"""The search space: what the search may choose, per layer and globally.

Per layer ``i``: ``k{i}``/``v{i}`` key and value bits in ``bits`` (a subset of {2, 3, 4, 8}; default all four), and one
on/off switch ``{method}{i}`` per method in ``layer_methods`` (a subset of the registry's
per-layer switches, :func:`layer_switches`: today ``center``, ``reorder``, ``clip``, which fit K
and V apart, and ``outliers``, OTT's pool, fitted on the whole layer). Global: ``group`` (tokens per key group,
channels per value group), ``window`` (recent tokens in full precision), ``sinks``, and
``schedule`` (PATS age tiers, ``layers.{i}.kv.schedule``; see below).

Every ``window`` must be 0 or at least every ``group`` (the runtime flushes whole groups out of
the window; see :class:`~kvcalib.layout.LayerConfig`), so any sampled pair is valid.

A space file is JSON or YAML with any subset of the keys of :class:`SearchSpace`::

    {"bits": [2, 3, 4, 8], "groups": [32, 64], "windows": [64, 128], "sinks": [0, 4],
     "layer_methods": ["rotate", "clip"], "schedules": ["none"]}

Unknown keys, an empty file and values outside the allowed sets are refused with a
:class:`~kvcalib.errors.KvcalibError` naming the key. Optuna is not imported here.

Schedules. ``schedules`` lists the global choices: ``"none"`` (every flushed token keeps its
layer's bits), ``"ages:A,B,..."`` (the layer's sinks, window and bits, then bits halved at token
ages A, B, ...: 8 -> 4 -> 2), or a PATS name for ages 1024 and 4096 (as ``kvcalib export
--schedule``): ``"middle-heavy"`` (both ends kept: the space's ``sinks`` must all be >= 1) or
``"old-heavy"`` (no sinks: the space's ``sinks`` must be ``[0]``). ``new-heavy`` (every token at
the lowest bits from the start) is not a per-layer-bits schedule and is not searched. The tiers
come from :class:`kvcalib.methods.schedule.ScheduleMethod` (``Schedule.from_layer``), which declares
this dimension (``search = "global"``: its names, checks and scoring length); the space reaches it
through the registry. The
default space has ``["none"]`` only; outliers are off by default too (``layer_methods: ["rotate",
"clip"]``, the methods whose ``search_default`` is set).

Honesty rule for schedules (:func:`check_scored_schedules`). Effective bits are counted at
``context`` (4096 by default), but the KL objective is scored on ``seq_len``-token sequences. A
tier that holds tokens at ``context`` but none in a ``seq_len``-token sequence lowers the counted
bits while the KL never sees its error, so the search would reward a schedule it never scored.
Such a space is **refused** (:class:`SpaceError` naming the schedule, the age and the
``--seq-len`` that would score it). Ages are not scaled down to the scoring length instead: the
recipe shipped must be the recipe scored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvcalib.errors import KvcalibError
from kvcalib.layout import LayerConfig
from kvcalib.methods import registry as _registry

# the space's one global choice, ``schedules``, is declared by the method whose ``search`` is "global"
# (PATS: kvcalib.methods.schedule.ScheduleMethod): its names, its checks and the scoring length it needs
_SCHEDULES = next(m for m in _registry().values() if m.search == "global")
NO_SCHEDULE = _SCHEDULES.search_off

# the default space's widths: each decodes in the fused kernel faster than bf16 attention
# (tests/unit/test_default_space_kernel.py samples the space and checks each layer's kernel path).
# 3-bit codes (a 2-bit tile plus its high-bit tile) joined once the kernel read them faster than bf16
# everywhere it was measured: one attention call of the Mistral-7B shape (H200, CUDA-graph time
# against bf16 SDPA's, artifacts/bench/HISTORY.md, "3-bit loop without the selects") runs 1.24x /
# 1.62x at batch 1 and 4k / 32k, 1.53x / 2.02x at batch 8 (2-bit: 1.41-3.60x); on SmolLM2 (head_dim
# 64) the 3-bit-code recipes decode at 4.2-6.7x bf16 `generate` in the CUDA-graph modes
# (artifacts/bench/real_model.md, runs f-h). Before that change 3 bits were opt-in (1.05-1.09x).
SEARCH_BITS = (2, 3, 4, 8)
ALLOWED_SEARCH_BITS = (2, 3, 4, 8)  # widths a space may name


def layer_switches() -> tuple[str, ...]:
    """Methods the search may switch on and off per layer (``Method.search == "layer"``), in
    pipeline order."""
    from kvcalib.methods import registry

    return tuple(name for name, m in registry().items() if m.search == "layer")


def default_layer_methods() -> tuple[str, ...]:
    """The switches of the default space (``Method.search_default``)."""
    from kvcalib.methods import registry

    return tuple(name for name, m in registry().items() if m.search == "layer" and m.search_default)


def side_scoped(name: str) -> bool:
    """Whether method ``name`` fits K and V apart (all its tensors are ``layers.{i}.k|v.*``)
    rather than the whole layer (``layers.{i}.kv.*``)."""
    from kvcalib.methods import registry

    return all(spec.sides != ("kv",) for spec in registry()[name].tensors)


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


def schedule_ages(name: str) -> tuple[int, ...]:
    """The method's ``search_ages`` (:func:`kvcalib.methods.schedule.schedule_ages`), refusing with a
    :class:`SpaceError`."""
    try:
        return _SCHEDULES.search_ages(name)
    except ValueError as err:
        raise SpaceError(str(err)) from None


@dataclass(frozen=True)
class SearchSpace:
    """Choices the search samples from (user configuration; validated on construction)."""

    bits: tuple[int, ...] = SEARCH_BITS  # per-layer K and V bits
    groups: tuple[int, ...] = (32, 64)
    windows: tuple[int, ...] = (64, 128)
    sinks: tuple[int, ...] = (0, 4)
    layer_methods: tuple[str, ...] = field(default_factory=default_layer_methods)  # per-layer on/off switches
    k_axis: str = "channel"
    schedules: tuple[str, ...] = (NO_SCHEDULE,)  # global choice (module docstring)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalise in place
        set_(self, "bits", _int_tuple("bits", self.bits, ALLOWED_SEARCH_BITS))
        set_(self, "groups", _int_tuple("groups", self.groups, low=1))
        set_(self, "windows", _int_tuple("windows", self.windows, low=0))
        set_(self, "sinks", _int_tuple("sinks", self.sinks, low=0))
        if isinstance(self.layer_methods, str) or not hasattr(self.layer_methods, "__iter__"):
            raise SpaceError(f"search space key 'layer_methods' must be a list, got {self.layer_methods!r}")
        methods = tuple(dict.fromkeys(self.layer_methods))
        switches = layer_switches()
        bad = [m for m in methods if m not in switches]
        if bad:
            hint = " ('schedule' is a global choice: use the 'schedules' key)" if "schedule" in bad else ""
            raise SpaceError(f"search space key 'layer_methods': unknown method(s) {bad}; use a subset of "
                             f"{list(switches)}{hint}")
        set_(self, "layer_methods", tuple(m for m in switches if m in methods))
        if self.k_axis not in ("channel", "token"):
            raise SpaceError(f"search space key 'k_axis' must be 'channel' or 'token', got {self.k_axis!r}")
        short = [w for w in self.windows if w and w < max(self.groups)]
        if short:
            raise SpaceError(f"search space: windows {short} are shorter than group {max(self.groups)}; "
                             "every window must be 0 or at least every group (the runtime flushes whole groups)")
        if isinstance(self.schedules, str) or not hasattr(self.schedules, "__iter__"):
            raise SpaceError(f"search space key 'schedules' must be a list, got {self.schedules!r}")
        schedules = tuple(dict.fromkeys(self.schedules))
        if not schedules:
            raise SpaceError("search space key 'schedules' is empty: give at least one value (e.g. ['none'])")
        for name in schedules:
            schedule_ages(name)  # a name the method knows, refused as a SpaceError
            try:
                _SCHEDULES.check_search_choice(name, self)
            except ValueError as err:
                raise SpaceError(str(err)) from None
        set_(self, "schedules", schedules)

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
        """A hash of the space and layer count: a study only continues in the same space.

        ``schedules`` enters the hash only when it is not the default ``["none"]``, so studies
        made before schedules existed keep their fingerprint (and resume).
        """
        space = self.to_dict()
        if tuple(space["schedules"]) == (NO_SCHEDULE,):
            del space["schedules"]
        doc = json.dumps({"space": space, "num_layers": num_layers}, sort_keys=True)
        return hashlib.sha256(doc.encode()).hexdigest()[:16]

    @property
    def searches_schedule(self) -> bool:
        """Whether the schedule is a sampled parameter (more than one choice)."""
        return len(self.schedules) > 1

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
        schedule = (trial.suggest_categorical("schedule", list(self.schedules)) if self.searches_schedule
                    else self.schedules[0])
        return Point(group, window, sinks, tuple(k), tuple(v), tuple(methods), self.k_axis, schedule)

    def floor_point(self, num_layers: int, schedule: str | None = None) -> "Point":
        """The cheapest point of the space without method switches: every layer at its fewest
        bits (with ``schedule``, default the first of :attr:`schedules`)."""
        return Point(max(self.groups), min(self.windows), min(self.sinks), (min(self.bits),) * num_layers,
                     (min(self.bits),) * num_layers, ((),) * num_layers, self.k_axis,
                     self.schedules[0] if schedule is None else schedule)


def min_scoring_length(space: SearchSpace, context: int) -> int:
    """The shortest scoring sequence in which every schedule tier that holds tokens at ``context``
    also holds tokens, for every (bits, group, window, sinks) of ``space``; 0 without schedules
    (the method's ``min_scoring_length`` over the space's ``schedules``)."""
    return max((_SCHEDULES.min_scoring_length(name, space, context) for name in space.schedules), default=0)


def check_scored_schedules(space: SearchSpace, seq_len: int, context: int) -> None:
    """Refuse schedules whose tiers the memory accounting at ``context`` counts but
    ``seq_len``-token scoring sequences never reach (the module docstring's honesty rule)."""
    for name in space.schedules:
        one = SearchSpace(bits=space.bits, groups=space.groups, windows=space.windows, sinks=space.sinks,
                          layer_methods=(), k_axis=space.k_axis, schedules=(name,))
        need = min_scoring_length(one, context)
        if need > seq_len:
            ages = [a for a in schedule_ages(name) if a < context]
            reach = seq_len - max(space.sinks) - max(space.groups)  # oldest age every scored layout reaches
            hint = (f"give ages the scoring sequences reach (between {max(space.windows) + 1} and {reach}, e.g. "
                    f"'ages:{reach}'), " if reach > max(space.windows) else "")
            raise SpaceError(
                f"search space schedule {name!r} lowers bits at token age(s) {ages}, which the {seq_len}-token "
                f"scoring sequences never reach, while effective bits at context {context} count those tokens at "
                f"the lower bits: the KL objective would reward a schedule it never scored. Score longer "
                f"sequences (--seq-len {need} or more), {hint}or drop the schedule.")


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
    schedule: str = NO_SCHEDULE  # global (SearchSpace.schedules)

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
                "methods": [list(m) for m in self.methods], "schedule": self.schedule}

    @classmethod
    def from_dict(cls, data: dict[str, Any], space: SearchSpace | None = None) -> "Point":
        """The point of a ``search.json`` trial record (``to_dict``); records written before
        schedules existed have none (``"none"``)."""
        k_axis = data.get("k_axis", space.k_axis if space is not None else "channel")
        return cls(int(data["group"]), int(data["window"]), int(data["sinks"]), tuple(int(b) for b in data["k_bits"]),
                   tuple(int(b) for b in data["v_bits"]), tuple(tuple(m) for m in data.get("methods", ())),
                   k_axis, data.get("schedule", NO_SCHEDULE))

    @classmethod
    def from_params(cls, params: dict[str, Any], space: SearchSpace, num_layers: int) -> "Point":
        """The point of a finished trial's parameters."""
        return cls(int(params["group"]), int(params["window"]), int(params["sinks"]),
                   tuple(int(params[f"k{i}"]) for i in range(num_layers)),
                   tuple(int(params[f"v{i}"]) for i in range(num_layers)),
                   tuple(tuple(m for m in space.layer_methods if params.get(f"{m}{i}")) for i in range(num_layers)),
                   space.k_axis, params.get("schedule", space.schedules[0]))


def point_params(point: Point, space: SearchSpace) -> dict[str, Any]:
    """All Optuna parameters of ``point`` in ``space`` (method switches and schedule included)."""
    out = point.params()
    for i, methods in enumerate(point.methods or ((),) * len(point.k_bits)):
        for m in space.layer_methods:
            out[f"{m}{i}"] = m in methods
    if space.searches_schedule:
        out["schedule"] = point.schedule
    return out
