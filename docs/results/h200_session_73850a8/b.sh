# call B (chained after A): early epoch start A/B: main vs b2e6e4c (its parent), synthetic + gpu backend (nvJPEG), 2 rounds.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
[ -d /tmp/fake2 ] || { echo "fresh machine: writing /tmp/fake2"; python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 --val-per-class 2 --jobs 14 > /dev/null 2>&1; echo "fake2 t=$SECONDS"; }
F="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
timeout -k 5 ${BENCH_CAP:-$((565-SECONDS))} python3 tools/benchmark_input.py /tmp/fake2 --workers 8 --backends synthetic gpu --decoders cuda --compile reduce-overhead --opt-level O1 --steps-per-epoch 80 --epochs 3 --timeout 140 --other-code before --repeat ${REPEAT:-2} --out $OUT/bench_ab.csv > $OUT/bench_ab.log 2>&1; echo "bench rc=$? t=$SECONDS"
grep -vE "$F" $OUT/bench_ab.log | tail -16
