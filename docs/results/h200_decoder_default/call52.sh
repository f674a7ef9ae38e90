# stop 24, call B (chained after A): the same-run benchmark on main (fused-finish merged), one round.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
[ -d /tmp/fake2 ] || { echo "fresh machine: no /tmp/fake2"; exit 3; }
F="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
timeout -k 5 480 python3 tools/benchmark_input.py /tmp/fake2 --workers 8 --backends synthetic cpu gpu --decoders hardware cuda --compile reduce-overhead --opt-level O1 --steps-per-epoch 80 --epochs 3 --timeout 130 --out $OUT/bench_main.csv > $OUT/bench_main.log 2>&1; echo "bench rc=$? t=$SECONDS"
grep -vE "$F" $OUT/bench_main.log | tail -30
