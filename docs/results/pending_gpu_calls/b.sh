# Call B (right after A, on the same machine): the whole GPU suite (~160 s), then a third round.
source docs/results/pending_gpu_calls/common.sh
make_data 16
timeout -k 5 300 python3 -m pytest -v -n 4 -m gpu tests -p no:cacheprovider --durations=10 > $OUT/gpu_suite.log 2>&1
echo "suite rc=$? t=$SECONDS"
grep -vE "$NOISE" $OUT/gpu_suite.log | grep -E "FAILED|ERROR|passed|failed" | tail -15
benchmark_round r3
