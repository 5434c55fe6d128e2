"""Main-loop SASS histogram of each .sass given, columns side by side (the first is the reference):

    python -m experiments.sass_loopdiff A.sass B.sass ...

:func:`main_loop` is the rule experiments/compile_sm90.py reports with: the largest backward branch
whose body has no bfloat16 MMA (those are the full-precision chunk's; regions spanning both branches
of the kernel are not the loop)."""
import collections
import re
import sys


def main_loop(sass: str) -> tuple[int, collections.Counter]:
    """(instructions in the packed main loop, opcode counts) of nvdisasm output ``sass``."""
    ins, addr, cur = [], {}, None
    for l in sass.splitlines():
        m = re.match(r"\.L_x_(\d+):", l.strip())
        if m:
            cur = m.group(1)
            continue
        m2 = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", l)
        if m2:
            a = int(m2.group(1), 16)
            ins.append((a, m2.group(2)))
            if cur is not None:
                addr[cur], cur = a, None
    loops = []
    for a, t in ins:
        m = re.search(r"BRA.*?\.L_x_(\d+)", t)
        if m and m.group(1) in addr and addr[m.group(1)] < a:
            body = [x for x in ins if addr[m.group(1)] <= x[0] <= a]
            cc = collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", x[1]).group(1) for x in body)
            loops.append((len(body), cc))
    packed = [L for L in loops if not any(op.endswith(".BF16") for op in L[1])]
    return max(packed or loops, key=lambda L: L[0])


if __name__ == "__main__":
    Ls = [main_loop(open(p).read()) for p in sys.argv[1:]]
    keys = sorted(set().union(*[L[1] for L in Ls]), key=lambda k: -max(L[1][k] for L in Ls))
    print("%-28s" % "op" + "".join("%12s" % p.split('/')[-2][:11] for p in sys.argv[1:]))
    print("%-28s" % "TOTAL" + "".join("%12d" % L[0] for L in Ls))
    for k in keys:
        if max(L[1][k] for L in Ls) >= 4:
            print("%-28s" % k + "".join("%12d" % L[1][k] for L in Ls))
