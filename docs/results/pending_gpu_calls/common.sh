# Sourced by a.sh, b.sh and c.sh on the device: wheels, environment, the data folder if this is a fresh
# machine, the benchmark (rounds added to one CSV with --append) and the GPU suite.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
NOISE="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
make_data() {
    [ -d /tmp/fake2 ] || { python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 \
        --val-per-class 2 --jobs ${1:-16} > /dev/null 2>&1; echo "fake2 written rc=$? t=$SECONDS"; }
}
benchmark_round() {  # one round, capped so that the call ends by CAP (575) s; the CSV keeps what finished
    timeout -k 5 $((${CAP:-575} - SECONDS)) python3 tools/benchmark_input.py /tmp/fake2 --workers 8 \
        --backends synthetic gpu --decoders cuda --compile reduce-overhead --opt-level O1 \
        --steps-per-epoch 80 --epochs 3 --timeout 140 --other-code before --append \
        --out /tmp/bench.csv --runs-dir /tmp > $OUT/bench_$1.log 2>&1
    echo "bench $1 rc=$? t=$SECONDS"
    cp /tmp/bench.csv $OUT/bench.csv
    [ -d /tmp/benchmark-logs ] && cp -r /tmp/benchmark-logs $OUT/  # each run's printed output (its interval lines)
    grep -vE "$NOISE" $OUT/bench_$1.log | grep -E "^train|^plain|^=>|^   " | cut -c1-160
}
gpu_suite() {  # the whole GPU suite, stopped after $1 s
    timeout -k 5 $1 python3 -m pytest -v -n 4 -m gpu tests -p no:cacheprovider --durations=10 > $OUT/gpu_suite.log 2>&1
    echo "suite rc=$? t=$SECONDS"
    grep -vE "$NOISE" $OUT/gpu_suite.log | grep -E "FAILED|ERROR|passed|failed" | tail -15
}
