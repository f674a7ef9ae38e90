# Call A (a fresh machine): the data folder, then two rounds of the benchmark (5 runs, ~140 s a round on an H100).
source docs/results/pending_gpu_calls/common.sh
make_data 16
benchmark_round r1
benchmark_round r2
