"""Compile the decode split kernel (kvcalib_kernels.decode.split_kernel) for sm_90 (H100/H200) on a
machine with no GPU, with the ptxas/nvdisasm bundled in the triton wheel, and report TTGIR op
counts, shared memory, register use and the SASS instruction mix of the main (packed) loop, as
the launcher would run it (its rules pick the paths). Costs no device time.

    python -m experiments.compile_sm90 BITS BLOCK_N WARPS UNPACK [STAGES]      e.g.  2 64 1 5
    KV_FITTED=perm,mean8 python -m experiments.compile_sm90 ...   (with SKVQ permutations / TaDA means)
    KV_GROUPS=32,32 python -m experiments.compile_sm90 4 64 1 5   (key group, value group; default 128,128)
    KV_SHAPE=3,3,64 ...   (kv heads, query heads per kv head, head_dim; default Mistral's 8,4,128)

(The instruction counts in artifacts/bench/HISTORY.md came from earlier versions of this script,
whose environment variables also forced settings since removed from the kernel.)

Shapes: Mistral-7B (8 kv heads, 4 query heads each, head_dim 128) or $KV_SHAPE, key/value group 128 (or
$KV_GROUPS), batch 8.
The launcher is run on CPU tensors with the kernel replaced by a recorder; the recorded arguments
are bound with triton's own binder for a CUDA sm_90 target (same specialization as a real launch).
Outputs (.ttgir, .ptx, .cubin, .sass) go to $OUT_DIR (default /tmp/compile_sm90)."""
import os, sys, re, torch, triton
OUT_DIR = os.environ.get("OUT_DIR", "/tmp/compile_sm90")
os.makedirs(OUT_DIR, exist_ok=True)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvcalib_kernels.decode import combine, plan, split_kernel

bits, block_n, warps, unpack = (int(x) for x in sys.argv[1:5])
stages = int(sys.argv[5]) if len(sys.argv) > 5 else 2
rec = {}
class Rec:
    def __getitem__(self, grid):
        def call(*args, **kw):
            if "args" not in rec: rec["args"], rec["kw"] = args, kw
        return call
class RecLaunch:  # stands in for kvcalib_kernels.launch.FastLauncher: launcher(grid, args, meta)
    def __init__(self, record): self.record = record
    def __call__(self, grid, args, meta):
        if self.record and "args" not in rec: rec["args"], rec["kw"] = args, meta
real = split_kernel._decode_split_kernel
plan._SPLIT, combine._COMBINE = RecLaunch(True), RecLaunch(False)
plan.fast_unpack_available = lambda *a, **k: True
plan._lanes_verified = lambda *a, **k: True  # no GPU here to check the lane order on
_orig_plan = plan._plan.__wrapped__
def _plan(d, rep, kb, vb, kg, vg, ax, qd, fd, dev_type, idx, cfg, interp, halves=True):
    return _orig_plan(d, rep, kb, vb, kg, vg, ax, qd, fd, "cuda", idx, cfg, interp, halves)
plan._plan = _plan
b, n = 8, 4096
h, rep, d = (int(x) for x in os.environ.get("KV_SHAPE", "8,4,128").split(","))  # kv heads, GQA, head_dim
kg, vg = (int(x) for x in os.environ.get("KV_GROUPS", "128,128").split(","))
q = torch.randn(b, h * rep, d, dtype=torch.float16)
kc = torch.zeros(b, h, n, d * bits // 8, dtype=torch.uint8); vc = kc.clone()
ks = torch.zeros(b, h, n // kg, d, dtype=torch.float16); kz = ks.clone()
vs = torch.zeros(b, h, n, d // vg, dtype=torch.float16); vz = vs.clone()
w = torch.zeros(b, h, 128, d, dtype=torch.bfloat16)
cfg = plan.DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, unpack=unpack)
# KV_FITTED="perm,mean8" (or mean16): SKVQ permutations of K and V, TaDA means of K and V
fitted = os.environ.get("KV_FITTED", "")
extra = {}
if "perm" in fitted:
    extra["k_perm"] = extra["v_perm"] = torch.stack([torch.randperm(d) for _ in range(h)]).int()
if "mean16" in fitted:
    extra["k_mean"] = extra["v_mean"] = torch.zeros(b, 1, n, d, dtype=torch.float16)
elif "mean8" in fitted:
    extra["k_mean"] = extra["v_mean"] = (torch.zeros(b, 1, n, d, dtype=torch.uint8),
                                         torch.zeros(b, 1, n, 1, dtype=torch.float16),
                                         torch.zeros(b, 1, n, 1, dtype=torch.float16))
try:
    plan._launch(q, kc, ks, kz, vc, vs, vz, **extra, k_bits=bits, v_bits=bits, k_group=kg, v_group=vg, k_axis="channel",
               scaling=d ** -0.5, softcap=None, packed_start=None, packed_end=None, packed_position=0,
               fp_segments=[(w, w)], fp_positions=[n], mask=None, config=cfg)
except Exception as e:
    if "args" not in rec: raise
args, kw = rec["args"], rec["kw"]
fn = real
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
backend = make_backend(GPUTarget("cuda", 90, 32))
binder = create_function_from_signature(fn.signature, fn.params, backend)
bound_args, specialization, options = binder(*args, **kw)
options, signature, constexprs, attrs = fn._pack_args(backend, dict(kw), bound_args, specialization, options)
src = ASTSource(fn, signature, constexprs, attrs)
ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options.__dict__)
ttgir = ck.asm["ttgir"]
ops = {}
for m in re.finditer(r"= (tt\.\w+|ttg\.\w+|triton_gpu\.\w+|ttng\.\w+)", ttgir):
    ops[m.group(1)] = ops.get(m.group(1), 0) + 1
md = ck.metadata
print(f"bits={bits} block_n={block_n} warps={warps} unpack={unpack} stages={stages}: shared={md.shared}")
print({k: v for k, v in sorted(ops.items()) if any(s in k for s in ("convert", "local", "dot", "load", "async", "inline"))})
open(f"{OUT_DIR}/k{bits}_b{block_n}_w{warps}_u{unpack}.ttgir", "w").write(ttgir)
open(f"{OUT_DIR}/k{bits}_b{block_n}_w{warps}_u{unpack}.ptx", "w").write(ck.asm["ptx"])
open(f"{OUT_DIR}/k{bits}_b{block_n}_w{warps}_u{unpack}.cubin", "wb").write(ck.asm["cubin"])

import subprocess, os
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
p = f"{OUT_DIR}/k{bits}_b{block_n}_w{warps}_u{unpack}.ptx"
nvd = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
sass = subprocess.run([nvd, "-c", f"{OUT_DIR}/k{bits}_b{block_n}_w{warps}_u{unpack}.cubin"], capture_output=True, text=True).stdout
open(f"{OUT_DIR}/k{bits}_b{block_n}_w{warps}_u{unpack}.sass", "w").write(sass)
import collections
c = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M))
print("SASS total", sum(c.values()))
from experiments.sass_loopdiff import main_loop  # the packed loop: experiments/sass_loopdiff.py's rule
n_loop, loop_ops = main_loop(sass)
print("main loop", (n_loop, loop_ops.most_common(16)))
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
usage = subprocess.run([cuobjdump, "--dump-resource-usage", f"{OUT_DIR}/k{bits}_b{block_n}_w{warps}_u{unpack}.cubin"],
                       capture_output=True, text=True).stdout
print("resources:", " ".join(l.strip() for l in usage.splitlines() if "REG:" in l))
