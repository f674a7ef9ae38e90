# call C (chained): cpu backend vs timm's train.py at -j 8 and -j 16, uncompiled, same folder, same invocation.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
[ -d /tmp/fake2 ] || { echo "fresh machine: writing /tmp/fake2"; python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 --val-per-class 2 --jobs 14 > /dev/null 2>&1; echo "fake2 t=$SECONDS"; }
F="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
timeout -k 5 ${BENCH_CAP:-$((565-SECONDS))} python3 tools/benchmark_input.py /tmp/fake2 --workers 8 16 --backends cpu --compile False --opt-level O1 --steps-per-epoch 80 --epochs 3 --timeout 150 --timm-train bench_timm/train.py --out $OUT/bench_cpu_timm.csv > $OUT/bench_cpu_timm.log 2>&1; echo "bench rc=$? t=$SECONDS"
grep -vE "$F" $OUT/bench_cpu_timm.log | tail -12
