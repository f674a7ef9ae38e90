# Call C (a fresh machine, because the one call A used was given back before b.sh could run): round 3
# first, appended to the CSV of rounds 1-2 (docs/results/h200_session_61ecf13/bench.csv; valid only while
# the input pipeline and training loop are 61ecf13's), then the GPU suite if 200 s or more are left.
source docs/results/pending_gpu_calls/common.sh
make_data 16
# A call for an H200 can be lent an H100 (2026-12-06): its round then stands alone in a fresh CSV,
# since benchmark_input.py refuses to add rounds timed on another card (the CSV's device column).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "H200"; then
    cp docs/results/h200_session_61ecf13/bench.csv /tmp/bench.csv
else
    echo "not an H200: this round is not the issue's figure and goes to a CSV of its own"
fi
benchmark_round r3
[ $((${CAP:-575} - SECONDS)) -ge 200 ] || { echo "no time left for the GPU suite (t=$SECONDS)"; exit 0; }
gpu_suite $((${CAP:-575} - SECONDS))
