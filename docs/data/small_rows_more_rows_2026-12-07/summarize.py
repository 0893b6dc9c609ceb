# Pairs the eager-tile and eager runs of each step_cost_N.txt (alternating, in one process) and
# prints each cell's ms and the kernel / tile ratio per pair, then the median ratio.
import re, sys, glob, statistics, os
here = os.path.dirname(os.path.abspath(__file__))
runs = []
for path in sorted(glob.glob(os.path.join(here, 'step_cost_*.txt'))):
    cur = None
    for l in open(path):
        if l.startswith('forward:'):
            cur = {}
            runs.append((l.split()[1], cur))
        m = re.match(r'\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)', l)
        if m and cur is not None:
            r, rows, t, tr, ms = m.groups()
            cur[(int(r), int(t))] = float(ms)
tile = [c for n, c in runs if n == 'eager-tile']
kern = [c for n, c in runs if n == 'eager']
print('requests tokens linear-rows | tile ms | kernel ms | kernel/tile per pair | median')
for k in tile[0]:
    ratios = [b[k] / a[k] for a, b in zip(tile, kern)]
    print(f'{k[0]:8d} {k[1]:6d} {2*k[1]:11d} | ' + ' '.join(f'{a[k]:.2f}' for a in tile) + ' | ' +
          ' '.join(f'{b[k]:.2f}' for b in kern) + ' | ' + ' '.join(f'{r:.2f}' for r in ratios) +
          f' | {statistics.median(ratios):.2f}')
