"""Is a reorganised split kernel bit-identical to another kernels tree's, on every launch the tests make?

A restructuring of ``_decode_split_kernel`` (code moved into ``@triton.jit`` helpers, constexprs
regrouped) must not change a single bit of what it writes. This runs a pytest selection once per
kernels tree, each in its own process with that tree linked in as ``kvcalib_kernels`` (as
``scripts/gpu_bench.sh`` does with ``KV_KERNELS``), and records, after every launch of the split
kernel, the partial results that launch wrote (its columns of ``m``, ``l`` and ``acc``: every
element of them is written by the launch, none is read from an uninitialised buffer) as a
SHA-256 per (test, launch). The two records must be equal launch for launch: the tests are the
grid of configurations (widths 2/3/4/8 on each side, every key layout and value path, rotation,
permutations, means, OTT, sliding windows, padded ranges, several splits), and the check is
``torch.equal`` by hash. The "before" side's constexprs of each launch are kept too, to report
which paths the selection reached. Test failures of either side are listed but are not the
check (a test of this branch may read a plan field the old tree names differently).

    git archive main kernels | tar -x -C /tmp/kernels_main
    python -m experiments.kernel_reorg_check --before /tmp/kernels_main/kernels [--after kernels] \
        [-- PYTEST ARGS ...]

Default selection: tests/kernels/test_decode_attention.py and test_quantizer_kernels.py (the
rotations), ``-n 2`` when pytest-xdist is there. On a CPU-only machine the tests choose Triton's
interpreter themselves (tests/kernels/triton_setup.py); on a GPU the same command compares the
compiled kernels (then add ``-m "gpu or not gpu"`` to take the full-size grid too).
Exit status 0 when every launch matches and both sides made the same launches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TESTS = ["tests/kernels/test_decode_attention.py", "tests/kernels/test_quantizer_kernels.py"]
# the constexprs whose values name a path (reported as coverage; whichever of them a tree has)
PATH_FIELDS = ("K_BITS", "V_BITS", "K_HI", "V_HI", "K_FOLD", "K_SUB", "K_HALVES", "V_FOLD", "V_NCH", "V_UNITS",
               "V_T", "V_SUM_DOTS", "V_EARLY", "K_UNPACK", "V_UNPACK", "K_PERM", "V_PERM", "K_MEAN", "V_MEAN",
               "HAS_KEEP", "ROT_Q", "WHOLE", "HAS_RANGE", "HAS_MASK", "MASK_PACKED", "HAS_SOFTCAP", "DOT_T",
               "BLOCK_N", "R_PAD")


# ---------------------------------------------------------------- the recording plugin (in each side's pytest)

class Recorder:
    """A pytest plugin: wraps ``kvcalib_kernels.decode.plan._SPLIT`` so that every split-kernel launch
    appends ``{test, i, hash, meta}`` to ``$KV_REORG_RECORD.<worker>``."""

    def __init__(self) -> None:
        self.test = None
        self.count = 0
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.out = open(f"{os.environ['KV_REORG_RECORD']}.{worker}", "a")

    def pytest_runtest_setup(self, item):
        import zlib

        import torch

        self.test, self.count = item.nodeid, 0
        # the same global RNG state on both sides (a test may draw inputs without a generator)
        torch.manual_seed(zlib.crc32(item.nodeid.encode()))
        self._wrap()

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.out.write(json.dumps({"test": report.nodeid, "outcome": report.outcome, "when": report.when}) + "\n")
            self.out.flush()

    def _wrap(self) -> None:
        plan = sys.modules.get("kvcalib_kernels.decode.plan")
        if plan is None or getattr(plan._SPLIT, "_reorg_recorder", False):
            return
        if not hasattr(plan, "split_fields"):  # a tree whose constexprs are named one per path already
            plan.split_fields = dict
        inner, rec = plan._SPLIT, self

        class Wrapped:
            _reorg_recorder = True

            def __getattr__(self, name):
                return getattr(inner, name)

            def __call__(self, grid, args, meta):
                inner(grid, args, meta)
                rec.record(grid, args, meta)

        plan._SPLIT = Wrapped()

    def record(self, grid, args, meta) -> None:
        import torch

        m_part, l_part, o_part, s_tot, s_off = args[6:11]  # (B*Hq, S_TOT), (B*Hq, S_TOT), (B*Hq, S_TOT, D)
        cols = slice(s_off, s_off + grid[1])
        if o_part.is_cuda:
            torch.cuda.synchronize()
        h = hashlib.sha256()
        for t in (m_part[:, cols], l_part[:, cols], o_part[:, cols]):
            h.update(t.detach().contiguous().cpu().numpy().tobytes())
        fields = sys.modules["kvcalib_kernels.decode.plan"].split_fields(meta)  # one entry per path
        self.out.write(json.dumps({"test": self.test, "i": self.count, "hash": h.hexdigest(),
                                   "meta": {k: repr(v) for k, v in fields.items()}}) + "\n")
        self.out.flush()
        self.count += 1


def pytest_configure(config):  # loaded with -p experiments.kernel_reorg_check
    if os.environ.get("KV_REORG_RECORD"):
        config.pluginmanager.register(Recorder(), "kv_reorg_recorder")


# ---------------------------------------------------------------- the driver

def run_side(tree: Path, record: Path, pytest_args: list[str]) -> tuple[int, float]:
    """One pytest run with ``tree`` linked in as kvcalib_kernels; returns (exit status, seconds)."""
    import time

    link_dir = Path(tempfile.mkdtemp(prefix="kv_reorg_"))
    (link_dir / "kvcalib_kernels").symlink_to(tree.resolve())
    env = dict(os.environ, KV_REORG_RECORD=str(record),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(link_dir), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "experiments.kernel_reorg_check",
           *pytest_args]
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    return rc, time.time() - t0


def load(record: Path) -> tuple[dict, dict]:
    """(launches {(test, i): (hash, meta)}, outcomes {test: outcome of a failed phase or 'passed'})."""
    launches, outcomes = {}, {}
    for f in sorted(record.parent.glob(record.name + ".*")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if "hash" in r:
                launches[(r["test"], r["i"])] = (r["hash"], r["meta"])
            elif r["outcome"] != "passed" or r["test"] not in outcomes:
                outcomes[r["test"]] = r["outcome"]
    return launches, outcomes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, type=Path, help="the kernels/ tree to compare against")
    ap.add_argument("--after", default=ROOT / "kernels", type=Path, help="the kernels/ tree under test")
    ap.add_argument("--keep", type=Path, help="a folder to keep both sides' records in")
    ap.add_argument("--reuse-before", action="store_true",
                    help="take the before side's records from --keep (an earlier run of the same selection)")
    ap.add_argument("pytest_args", nargs="*", help="pytest selection and options (after --)")
    a = ap.parse_args(argv)
    pytest_args = a.pytest_args or list(DEFAULT_TESTS)
    if "-n" not in pytest_args:
        try:
            import xdist  # noqa: F401
            pytest_args = ["-n", "2", *pytest_args]
        except ImportError:
            pass
    work = a.keep or Path(tempfile.mkdtemp(prefix="kv_reorg_records_"))
    work.mkdir(parents=True, exist_ok=True)
    sides = {}
    for side, tree in (("before", a.before), ("after", a.after)):
        record = work / f"{side}.jsonl"
        if side == "before" and a.reuse_before:
            sides[side] = load(record)
            print(f"before: records of {work} reused, {len(sides[side][0])} split-kernel launches")
            continue
        for old in work.glob(record.name + ".*"):
            old.unlink()
        rc, secs = run_side(tree, record, pytest_args)
        sides[side] = load(record)
        print(f"{side}: {tree} pytest exit {rc}, {secs:.0f} s, {len(sides[side][0])} split-kernel launches")
    (before, out_b), (after, out_a) = sides["before"], sides["after"]
    differ = sorted(k for k in before.keys() & after.keys() if before[k][0] != after[k][0])
    only = sorted(before.keys() ^ after.keys())
    for side, outcomes in (("before", out_b), ("after", out_a)):
        bad = sorted(t for t, o in outcomes.items() if o == "failed")
        if bad:
            print(f"{side}: {len(bad)} tests failed (not the check):", *bad[:20], sep="\n  ")
    cover: dict[str, set] = {}
    for _, meta in before.values():
        for f in PATH_FIELDS:
            if f in meta:
                cover.setdefault(f, set()).add(meta[f])
    print("paths reached (before side's constexprs):")
    for f, vals in cover.items():
        print(f"  {f}: {', '.join(sorted(vals))}")
    print(f"launches compared: {len(before.keys() & after.keys())}, different: {len(differ)}, "
          f"made by one side only: {len(only)}")
    for k in differ[:20]:
        print("  DIFFERENT", k, before[k][1])
    for k in only[:20]:
        print("  ONE SIDE ONLY", k)
    ok = not differ and not only and before
    print("BIT-IDENTICAL" if ok else "NOT IDENTICAL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
