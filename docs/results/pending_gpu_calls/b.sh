# Call B (right after A, on the same machine): the whole GPU suite (~160 s), then a third round.
source docs/results/pending_gpu_calls/common.sh
make_data 16
gpu_suite 300
benchmark_round r3
