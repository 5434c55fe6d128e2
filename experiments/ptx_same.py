"""Does a kernels tree compile the split kernel of each existing layout to the same PTX as another?

A refactor that only adds compile-time paths (a new code width behind a constexpr that is off
for the old layouts) must leave every old layout's machine code unchanged: same PTX means same
speed, no benchmark noise to argue about. Run once per tree (the tree is chosen by which
``kvcalib_kernels`` the import finds: scripts/device_env.sh's ``KV_KERNELS``), then compare:

    python -m experiments.ptx_same --out before.json      (with the old tree)
    python -m experiments.ptx_same --out after.json --compare before.json

Layouts: the Mistral-7B, Qwen2.5-1.5B and SmolLM2 shapes at 2, 4 and 8 bits, groups 128 and 32,
batch 1 and 8 (block and split choices differ), a rotated 2-bit cache (the in-kernel query
rotation) and a padded-batch range. ``.loc``/``.file`` lines and comments are dropped first (the
source lines moved).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re

import torch


def _strip(ptx: str) -> str:
    keep = [ln for ln in ptx.splitlines()
            if not re.match(r"\s*(\.loc|\.file|//|\$L__|\.section\s+\.debug)", ln)]
    text = "\n".join(keep)
    return re.sub(r"\.section\s+\.debug.*", "", text, flags=re.S)  # DWARF sections at the end


def layouts():
    for model, (hq, h, d) in {"mistral": (32, 8, 128), "qwen": (12, 2, 128), "smol": (9, 3, 64)}.items():
        for bits, group in ((2, 128), (4, 128), (4, 32), (8, 64), (2, 32)):
            for b in (1, 8):
                yield dict(model=model, hq=hq, h=h, d=d, bits=bits, group=group, b=b)


def compile_one(case: dict) -> list[str]:
    from benchmarks.common import packed_inputs
    from kvcalib_kernels.decode import plan
    from kvcalib_kernels.decode_attention import decode_attention

    dev = torch.device("cuda")
    b, h, hq, d, bits, group = case["b"], case["h"], case["hq"], case["d"], case["bits"], case["group"]
    n = 4096
    vg = min(group, d)
    packed = packed_inputs(b, h, n, d, bits, group, vg, dev)
    window = (torch.randn(b, h, 128, d, device=dev, dtype=torch.bfloat16),
              torch.randn(b, h, 128, d, device=dev, dtype=torch.bfloat16))
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
    plan._SPLIT.compiled.clear()
    decode_attention(q, *packed, k_bits=bits, v_bits=bits, k_group=group, v_group=vg, scaling=d ** -0.5,
                     fp_segments=[window], fp_positions=[n])
    torch.cuda.synchronize()
    return [hashlib.sha256(_strip(k.asm["ptx"]).encode()).hexdigest()[:16]
            for k, _ in plan._SPLIT.compiled.values()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", default=None)
    args = ap.parse_args()
    out = {}
    for case in layouts():
        name = "{model}-{bits}b-g{group}-b{b}".format(**case)
        out[name] = compile_one(case)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        same = [k for k in out if before.get(k) == out[k]]
        diff = [k for k in out if before.get(k) != out[k]]
        print(f"ptx_same: {len(same)} of {len(out)} layouts compile to the same PTX; differ: {diff}")


if __name__ == "__main__":
    main()
