#!/bin/bash
# Alternating single-shape runs of two imagegen-step-cost binaries: A=path B=path ab.sh FORWARD REQUESTS TOKENS PAIRS
# (A: build/noomp, -DIMAGEGEN_ENGINE_OPENMP=OFF; B: build/ci, the OpenMP build; same commit). Prints medians, ranges, B/A.
fw=$1 req=$2 tok=$3 n=$4
for i in $(seq $n); do
  a=$($A --forwards $fw --requests $req --tokens $tok --reps 40 2>&1 | tail -1 | awk '{print $5}')
  b=$($B --forwards $fw --requests $req --tokens $tok --reps 40 2>&1 | tail -1 | awk '{print $5}')
  echo "$a $b"
done | python3 -c "
import sys,statistics as st
p=[tuple(map(float,l.split())) for l in sys.stdin if l.strip()]
a=[x for x,_ in p]; b=[y for _,y in p]; r=sorted(y/x for x,y in p)
print('%-14s r%-3s t%-4s A %.3f (%.3f-%.3f)  B %.3f (%.3f-%.3f)  B/A %.3f (%.3f-%.3f) B ahead %d/%d'%('$fw','$req','$tok',st.median(a),min(a),max(a),st.median(b),min(b),max(b),st.median(r),r[0],r[-1],sum(1 for x in r if x<1),len(r)))
"
