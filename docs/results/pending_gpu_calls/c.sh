# Call C (right after B): the whole GPU suite on this code (4 pytest-xdist workers, ~200 s on an
# H200), then a third round of the benchmark in the time left (the CSV keeps the runs that finish).
source docs/results/pending_gpu_calls/common.sh
make_data 16
timeout -k 5 300 python3 -m pytest -v -n 4 -m gpu tests -p no:cacheprovider --durations=10 > $OUT/gpu_suite.log 2>&1
echo "suite rc=$? t=$SECONDS"
grep -vE "$NOISE" $OUT/gpu_suite.log | grep -E "FAILED|ERROR|passed|failed" | tail -15
benchmark_round r3
