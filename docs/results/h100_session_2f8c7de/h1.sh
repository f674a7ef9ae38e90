# call H1: the hand-over change (wait placed when the loop takes a batch) against the code before it
# (before/ = cacdccd), profile.py phase tables; random tensors; gpu backend with the collector off.
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
F="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pytest_xdist*.whl .whl/execnet*.whl > /dev/null 2>&1
[ -d /tmp/fake2 ] || { python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 --val-per-class 2 --jobs 16 > /dev/null 2>&1; echo "fake2 t=$SECONDS"; }
COMMON="-a resnet50 -b 256 --opt-level O1 --compile True --compile-mode reduce-overhead --prof 100 --prof-steps 60"
GPU="$COMMON -j 8 --data-backend gpu --jpeg-decoder cuda /tmp/fake2"
run() { name=$1; shift; timeout -k 5 150 "$@" > $OUT/$name.log 2>&1; echo "$name rc=$? t=$SECONDS"; }
run new_gpu python3 profile.py $GPU
(cd before && run old_gpu python3 profile.py $GPU)
run synthetic python3 profile.py $COMMON synthetic
run new_gpu_nogc python3 -c "import gc, runpy, sys; gc.disable(); sys.argv = ['profile.py'] + sys.argv[1:]; runpy.run_path('profile.py', run_name='__main__')" $GPU
for f in new_gpu old_gpu synthetic new_gpu_nogc; do echo "== $f"; grep -vE "$F" $OUT/$f.log | sed -n '/=> phases/,$p' | head -18; done
timeout -k 5 150 python3 -m pytest -q -n 4 -m gpu tests/test_gpu_batches.py -k "hand_over" -p no:cacheprovider 2>&1 | tail -3; echo "tests t=$SECONDS"
