#!/bin/bash
# One test a process; base and new alternate, the order flipped from one test to the next.
export OMP_NUM_THREADS=1 GLIBC_TUNABLES=glibc.malloc.mmap_threshold=2147483647:glibc.malloc.trim_threshold=4294967295
cd /work/main
out=/tmp/toyab/times.csv
echo "test,build,seconds,result" > $out
i=0
for f in EngineExactTest.CoBatchedLosslessMethodsMatchTheExactArDistribution \
         SpecBatchPreemptionTest.SuspendedAndResumedRequestsKeepTheExactDistribution \
         SpecFusedProbsTest.LosslessMethodsKeepTheExactDistribution \
         SpeculativeLossyTest.JacobiLossyMethodsReportTheirDistance \
         'Presets/SpecLosslessTest.*' \
         'Presets/SpecLosslessTest.MatchesTheExactArDistribution/scd_mc_L6' ; do
  if (( i % 2 == 0 )); then order="base new"; else order="new base"; fi
  for b in $order; do
    s=$(date +%s.%N)
    /tmp/engine_tests.$b --gtest_filter="$f" > /tmp/toyab/$b.$i.log 2>&1; rc=$?
    e=$(date +%s.%N)
    echo "$f,$b,$(echo "$e - $s" | bc),$rc" >> $out
  done
  i=$((i+1))
done
echo done > /tmp/toyab/done
