import re, sys, collections
def loop(path):
    L=open(path).read().splitlines(); lab={}
    for i,l in enumerate(L):
        m=re.match(r"^\$(L__BB\d+_\d+):",l.strip())
        if m: lab[m.group(1)]=i
    best=None
    for i,l in enumerate(L):
        m=re.search(r"bra(?:\.uni)?\s+\$(L__BB\d+_\d+);",l)
        if m and m.group(1) in lab and lab[m.group(1)]<i:
            body=[x.strip() for x in L[lab[m.group(1)]:i+1] if x.strip() and not x.strip().startswith(('$','//','{','}'))]
            if any('bf16' in x and 'mma' in x for x in body): continue
            if best is None or len(body)>len(best): best=body
    c=collections.Counter()
    for x in best:
        op=re.sub(r"^@!?%p\d+\s+","",x).split()[0].rstrip(';')
        c[op]+=1
    return len(best), c
rs=[loop(p) for p in sys.argv[1:]]
keys=sorted(set().union(*[r[1] for r in rs]), key=lambda k:-max(r[1][k] for r in rs))
print("%-34s"%"ptx op"+"".join("%10s"%p.split('/')[-1][:9] for p in sys.argv[1:]))
print("%-34s"%"TOTAL (loop body lines)"+"".join("%10d"%r[0] for r in rs))
for k in keys:
    if max(r[1][k] for r in rs)>=8: print("%-34s"%k+"".join("%10d"%r[1][k] for r in rs))
