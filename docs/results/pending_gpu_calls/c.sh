# Call C (a fresh machine, because the one call A used was given back before b.sh could run): round 3
# first, appended to the CSV of rounds 1-2 (docs/results/h200_session_61ecf13/bench.csv; valid only while
# the input pipeline and training loop are 61ecf13's), then the GPU suite if 200 s or more are left.
source docs/results/pending_gpu_calls/common.sh
# A call for an H200 can be lent an H100 (nineteen times on 2026-12-06). Five H100 rounds of this training code
# exist already (h100_session_52967d3, _6e6201b, _d980728), so on any other card stop here, before
# the data is written, and spend the device time on a later try instead.
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "H200"; then
    echo "not an H200: nothing run (t=$SECONDS)"; exit 0
fi
make_data 16
cp docs/results/h200_session_61ecf13/bench.csv /tmp/bench.csv
benchmark_round r3
[ $((${CAP:-575} - SECONDS)) -ge 200 ] || { echo "no time left for the GPU suite (t=$SECONDS)"; exit 0; }
gpu_suite $((${CAP:-575} - SECONDS))
