"""Which MMA does Triton emit on sm_90 for a one-warp ``tl.dot`` of float8 (e4m3) operands, the
tile shape of the decode kernel's key product (64 tokens x 128 channels @ 128 x 8 query rows)?
Compiled offline with the ptxas/nvdisasm bundled in the triton wheel (no GPU needed).

    python -m experiments.probe_fp8_dot

Why it matters: a float8 operand holds four 2-bit codes per 32-bit register, so one LOP3 would
unpack four codes instead of two (the float16 lanes' floor). That only pays if the MMA reads
float8 as it stands (``mma.sync ... m16n8k32 ... e4m3``); if Triton converts to float16 first, the
conversion costs what the unpack saved.
"""
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _tile_dot(A, B, C):
    offs_m = tl.arange(0, 64)
    offs_k = tl.arange(0, 128)
    offs_n = tl.arange(0, 8)
    a = tl.load(A + offs_m[:, None] * 128 + offs_k[None, :])  # (64, 128)
    b = tl.load(B + offs_k[:, None] * 8 + offs_n[None, :])  # (128, 8)
    tl.store(C + offs_m[:, None] * 8 + offs_n[None, :], tl.dot(a, b, out_dtype=tl.float32))  # (64, 8)


def main() -> None:
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    for dtype in ("*fp8e4nv", "*fp16"):
        src = ASTSource(_tile_dot, {"A": dtype, "B": dtype, "C": "*fp32"}, {})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
        ops = sorted(set(re.findall(r"\b(HMMA\S*|QMMA\S*|HGMMA\S*|F2FP\S*)", sass)))
        print(f"triton {triton.__version__}, sm_90, one warp, {dtype[1:]} operands: {', '.join(ops)}")


if __name__ == "__main__":
    main()
