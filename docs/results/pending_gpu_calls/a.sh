# Call A (a fresh machine): the data folder, then round 1 of the benchmark.
source docs/results/pending_gpu_calls/common.sh
make_data 16
benchmark_round r1
