"""Compile kvcalib_kernels.decode_attention's split kernel for sm_90 (H100/H200) on a machine with
no GPU, with the ptxas/nvdisasm bundled in the triton wheel, and report TTGIR op counts, shared
memory, register use and the SASS instruction mix of the main (packed) loop. Costs no device time.

    python scripts/compile_sm90.py BITS BLOCK_N WARPS UNPACK [STAGES [MIN_ROWS [MAXNREG]]]   e.g.  2 64 1 5
    KV_FITTED=perm,mean8 python scripts/compile_sm90.py ...   (with SKVQ permutations / TaDA means)
    KV_GROUPS=32,32 python scripts/compile_sm90.py 4 64 1 5 2 4   (key group, value group; default 128,128)
    KV_PAIRS=1 ...   (DecodeConfig.key_group_pairs: two key groups per block)
    KV_SHAPE=3,3,64 ...   (kv heads, query heads per kv head, head_dim; default Mistral's 8,4,128)
    KV_UNITS=0 ...   (DecodeConfig.value_units off: value codes read as bytes)
    KV_SUMDOTS=0 ...   (DecodeConfig.value_sum_products off: folded value sums by reductions)
    KV_EARLY=0|2 ...   (DecodeConfig.early_value_scales: value scales loaded at use / a block ahead)
    KV_VT=0|1 ...   (DecodeConfig.value_products_t off / on wherever it applies; unset: its default rule)
    KV_WHOLE=0|1 ...   (DecodeConfig.whole_blocks off / on where every block is whole; unset: its default rule)

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
import kvcalib_kernels.decode_attention as da

bits, block_n, warps, unpack = (int(x) for x in sys.argv[1:5])
stages = int(sys.argv[5]) if len(sys.argv) > 5 else 2
min_rows = int(sys.argv[6]) if len(sys.argv) > 6 else 16
maxnreg = int(sys.argv[7]) if len(sys.argv) > 7 else None
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
real = da._decode_split_kernel
da._decode_split_kernel = Rec()
da._combine_kernel = Rec().__class__()  # ignore
da._SPLIT, da._COMBINE = RecLaunch(True), RecLaunch(False)
da.fast_unpack_available = lambda *a, **k: True
da._lanes_verified = lambda *a, **k: True  # no GPU here to check the lane order on
_orig_plan = da._plan.__wrapped__
def _plan(d, rep, kb, vb, kg, vg, ax, qd, fd, dev_type, idx, cfg, interp):
    return _orig_plan(d, rep, kb, vb, kg, vg, ax, qd, fd, "cuda", idx, cfg, interp)
da._plan = _plan
b, n = 8, 4096
h, rep, d = (int(x) for x in os.environ.get("KV_SHAPE", "8,4,128").split(","))  # kv heads, GQA, head_dim
kg, vg = (int(x) for x in os.environ.get("KV_GROUPS", "128,128").split(","))
q = torch.randn(b, h * rep, d, dtype=torch.float16)
kc = torch.zeros(b, h, n, d * bits // 8, dtype=torch.uint8); vc = kc.clone()
ks = torch.zeros(b, h, n // kg, d, dtype=torch.float16); kz = ks.clone()
vs = torch.zeros(b, h, n, d // vg, dtype=torch.float16); vz = vs.clone()
w = torch.zeros(b, h, 128, d, dtype=torch.bfloat16)
cfg = da.DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, unpack=unpack, min_rows=min_rows,
                      maxnreg=maxnreg, key_group_pairs=os.environ.get("KV_PAIRS", "0") == "1",
                      value_units=os.environ.get("KV_UNITS", "1") == "1",
                      value_sum_products=os.environ.get("KV_SUMDOTS", "1") == "1",
                      early_value_scales=int(os.environ.get("KV_EARLY", "1")),
                      value_products_t={"0": False, "1": True}.get(os.environ.get("KV_VT", ""), None),
                      whole_blocks={"0": False, "1": True}.get(os.environ.get("KV_WHOLE", ""), None))
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
    da._launch(q, kc, ks, kz, vc, vs, vz, **extra, k_bits=bits, v_bits=bits, k_group=kg, v_group=vg, k_axis="channel",
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
ins=[]; addr_of_label={}; cur=None
for l in sass.splitlines():
    m=re.match(r"\.L_x_(\d+):",l.strip())
    if m: cur=m.group(1); continue
    m2=re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);",l)
    if m2:
        a=int(m2.group(1),16); ins.append((a,m2.group(2)))
        if cur is not None: addr_of_label[cur]=a; cur=None
loops=[]
for a,t in ins:
    m=re.search(r"BRA.*?\.L_x_(\d+)",t)
    if m and m.group(1) in addr_of_label and addr_of_label[m.group(1)]<a:
        body=[x for x in ins if addr_of_label[m.group(1)]<=x[0]<=a]
        cc=collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)",x[1]).group(1) for x in body)
        loops.append((len(body),cc.most_common()))
# the packed loop: the largest backward branch whose body has no bfloat16 MMA (those are the
# full-precision chunk's; regions spanning both branches of the kernel are not the loop)
packed = [L for L in loops if not any(op.endswith(".BF16") for op, _ in L[1])]
for L in sorted(packed or loops, reverse=True)[:1]: print("main loop", (L[0], L[1][:16]))
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
usage = subprocess.run([cuobjdump, "--dump-resource-usage", f"{OUT_DIR}/k{bits}_b{block_n}_w{warps}_u{unpack}.cubin"],
                       capture_output=True, text=True).stdout
print("resources:", " ".join(l.strip() for l in usage.splitlines() if "REG:" in l))
