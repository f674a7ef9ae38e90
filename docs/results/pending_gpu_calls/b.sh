# Call B (chained right after A, on the same machine): round 2.
source docs/results/pending_gpu_calls/common.sh
make_data 16
benchmark_round r2
