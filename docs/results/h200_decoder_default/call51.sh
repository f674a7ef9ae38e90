# stop 24, call A (fresh machine): the whole GPU suite on main, 4 xdist workers on the one GPU, beside the
# fake-data writer (6 jobs), capped 480 s; one line per test so a cut run still says which passed.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
F="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
python3 -c "import xdist, torch, torchvision, accelerate, timm; print('xdist', xdist.__version__, torch.__version__, torchvision.__version__, accelerate.__version__, timm.__version__)"
(python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 --val-per-class 2 --jobs 6 > /dev/null 2>&1; echo fake2 done t=$SECONDS) &
timeout -k 5 480 python3 -m pytest -v -n 4 -m gpu tests -p no:cacheprovider --durations=20 > $OUT/gpu_suite.log 2>&1; echo "suite rc=$? t=$SECONDS"
grep -vE "$F" $OUT/gpu_suite.log | grep -E "FAILED|ERROR|passed|failed|s call|s setup" | tail -30
echo "PASSED lines: $(grep -c PASSED $OUT/gpu_suite.log)"
wait
