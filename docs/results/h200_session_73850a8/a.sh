# call A (fresh machine): the whole GPU suite, 4 xdist workers, beside the fake-data writer; one line per test.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
F="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; git log -1 --format=%h 2>/dev/null
python3 -c "import xdist, torch, torchvision, accelerate, timm; print('xdist', xdist.__version__, torch.__version__, torchvision.__version__, accelerate.__version__, timm.__version__)"
(python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 --val-per-class 2 --jobs 6 > /dev/null 2>&1; echo "fake2 done rc=$? t=$SECONDS") &
timeout -k 5 ${SUITE_CAP:-450} python3 -m pytest -v -n 4 -m gpu tests -p no:cacheprovider --durations=15 > $OUT/gpu_suite.log 2>&1; echo "suite rc=$? t=$SECONDS"
grep -vE "$F" $OUT/gpu_suite.log | grep -E "FAILED|ERROR|passed|failed|s call|s setup" | tail -30
echo "PASSED lines: $(grep -c PASSED $OUT/gpu_suite.log)"
wait; ls /tmp/fake2/train | wc -l; du -sh /tmp/fake2
