# stop 24, call G (fresh machine): the repeat probe of torchvision's CUDA decode (digits, then fake2), then the
# same-run benchmark on the new code (early epoch start, auto = cuda), without the cpu row (measured this morning).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4 IMAGENET_AMP_CACHE=/tmp/cache
F="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
(python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 --val-per-class 2 --jobs 12 > /dev/null 2>&1; echo fake2 done t=$SECONDS) &
python3 -c "from utils.digits import ensure_digits; print(ensure_digits())"
timeout 60 python3 .bench/repeat_probe.py /tmp/cache/digits-v1 256 20 2>&1 | grep -vE "$F"
wait
timeout 60 python3 .bench/repeat_probe.py /tmp/fake2 256 10 2>&1 | grep -vE "$F"
timeout -k 5 250 python3 tools/benchmark_input.py /tmp/fake2 --workers 8 --backends synthetic gpu --decoders hardware cuda --compile reduce-overhead --opt-level O1 --steps-per-epoch 80 --epochs 3 --timeout 130 --out $OUT/bench_new.csv > $OUT/bench_new.log 2>&1; echo "bench rc=$? t=$SECONDS"
grep -vE "$F" $OUT/bench_new.log | tail -8
