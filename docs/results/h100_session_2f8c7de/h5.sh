# call H5: the batch taken ahead of the print step's sync (HEAD) vs the code before it (before/ = HEAD~1),
# alternating, 2 rounds; random tensors; first, beside the data writer, the deterministic/resume GPU tests on HEAD.
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pytest_xdist*.whl .whl/execnet*.whl > /dev/null 2>&1
(timeout -k 5 130 python3 -m pytest -q -n 3 -m gpu tests/test_gpu.py -k "deterministic or resume" -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "tests rc=$? t=$SECONDS"; tail -2 $OUT/gpu_tests.log) &
[ -d /tmp/fake2 ] || { python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 --val-per-class 2 --jobs 12 > /dev/null 2>&1; echo "fake2 t=$SECONDS"; }
wait
COMMON="-a resnet50 -b 256 --opt-level O1 --compile True --compile-mode reduce-overhead --prof 100 --prof-steps 60"
GPU="$COMMON --data-backend gpu -j 8 --jpeg-decoder cuda /tmp/fake2"
run() { name=$1; shift; timeout -k 5 110 "$@" > $OUT/$name.log 2>&1; echo "$name rc=$? t=$SECONDS $(grep -E '^throughput' $OUT/$name.log) | $(grep -E '^data wait +' $OUT/$name.log)"; grep -E "^data wait per|^host taking" $OUT/$name.log; }
run synthetic python3 profile.py $COMMON synthetic
for r in 1 2; do
run new_r$r python3 profile.py $GPU
(cd before && run before_r$r python3 profile.py $GPU)
done
