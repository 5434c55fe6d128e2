"""Shared fixtures: tiny random models of real architectures, built from configs (no network)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("KVCALIB_QUIET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY_ARCHS = ("llama", "mistral", "qwen2", "gemma3")


def tiny_config(arch: str, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                sliding_window: int = 8):
    """A 2-layer config of a real architecture; gemma3 gets one sliding and one global layer."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=128, hidden_size=heads * head_dim, intermediate_size=64,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, max_position_embeddings=512)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "gemma3":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return Gemma3TextConfig(**common, sliding_window=sliding_window, layer_types=types,
                                query_pre_attn_scalar=head_dim)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **kw), attn_implementation="sdpa")
    # random init gives tiny keys; scale k/v projections so statistics are not all ~0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                p.mul_(20)
    return model.eval()


@pytest.fixture(params=TINY_ARCHS)
def tiny_arch_model(request):
    return request.param, tiny_model(request.param)
