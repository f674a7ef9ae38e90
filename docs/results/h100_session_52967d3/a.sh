# As run on 2026-12-05 from docs/results/pending_gpu_calls/ (paths changed to this folder afterwards).
# Call A (a fresh machine): the data folder, then round 1 of the benchmark.
source docs/results/h100_session_52967d3/common.sh
make_data 16
benchmark_round r1
