import json, sys, gzip, collections
for path in sys.argv[1:]:
    op = gzip.open if path.endswith('.gz') else open
    ev = json.load(op(path))['traceEvents']
    k = [e for e in ev if e.get('cat') in ('kernel', 'gpu_memcpy', 'gpu_memset') and 'dur' in e]
    if not k: print(path, 'no kernels'); continue
    t0 = min(e['ts'] for e in k); t1 = max(e['ts'] + e['dur'] for e in k)
    print(f"== {path}: GPU span {(t1-t0)/1e3:.2f} ms, {len(k)} device events")
    by = collections.defaultdict(list)
    for e in k: by[e['tid']].append(e)
    for tid, es in sorted(by.items()):
        es.sort(key=lambda e: e['ts'])
        busy = sum(e['dur'] for e in es)
        print(f"  stream {tid}: {len(es)} events, busy {busy/1e3:.2f} ms")
        prev = None
        agg = collections.OrderedDict()
        for e in es:
            name = e['name'][:60]
            gap = (e['ts'] - prev) if prev is not None else 0
            prev = e['ts'] + e['dur']
            if 'nccl' in e['name'].lower() or e['dur'] > 200 or gap > 200:
                print(f"    +{(e['ts']-t0)/1e3:7.3f} ms  dur {e['dur']/1e3:6.3f}  gap {gap/1e3:6.3f}  {name}")
            a = agg.setdefault(name, [0, 0.0]); a[0] += 1; a[1] += e['dur']
        for n, (c, d) in sorted(agg.items(), key=lambda x: -x[1][1])[:6]:
            print(f"      {c:4d}x {d/1e3:7.3f} ms  {n}")
    cpu = [e for e in ev if e.get('cat') == 'cuda_runtime' and 'ynchronize' in e.get('name','') and e.get('dur',0) > 100]
    for e in cpu:
        print(f"  host {e['name']} +{(e['ts']-t0)/1e3:.3f} ms dur {e['dur']/1e3:.3f}")
