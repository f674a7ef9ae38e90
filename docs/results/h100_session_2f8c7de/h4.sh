# call H4 (same machine as H3): resampling stream priority -1 (main) vs 0, alternating, 3 rounds; random tensors again
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
COMMON="-a resnet50 -b 256 --opt-level O1 --compile True --compile-mode reduce-overhead --prof 100 --prof-steps 60"
GPU="$COMMON --data-backend gpu -j 8 --jpeg-decoder cuda /tmp/fake2"
run() { name=$1; shift; timeout -k 5 100 "$@" > $OUT/$name.log 2>&1; echo "$name rc=$? t=$SECONDS $(grep -E '^throughput' $OUT/$name.log) | $(grep -E '^data wait +' $OUT/$name.log)"; }
for r in 1 2 3; do
run prio1_r$r python3 profile.py $GPU
export PROBE_RESAMPLE_PRIORITY=0; run prio0_r$r python3 devcalls/probe_threads.py $OUT/prio0_r$r.json $GPU; unset PROBE_RESAMPLE_PRIORITY
done
run synthetic2 python3 profile.py $COMMON synthetic
