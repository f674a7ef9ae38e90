# stop 24, call C (fresh machine): fake2 written beside the GPU tests that cover today's changes (auto decoder =
# cuda; the next epoch started during validation), then a warm-up compile.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
F="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
[ -d /tmp/fake2 ] && echo "warm machine: fake2 there" || (python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 --val-per-class 2 --jobs 6 > /dev/null 2>&1; echo fake2 done t=$SECONDS) &
timeout -k 5 300 python3 -m pytest -v -n 3 -p no:cacheprovider --durations=8 tests/test_gpu_batches.py tests/test_speed_flags.py "tests/test_gpu.py::test_deterministic_gpu_runs_repeat_and_resume_exactly" "tests/test_gpu.py::test_sigterm_mid_epoch_then_resume_is_bit_exact_on_gpu" "tests/test_gpu.py::test_compiled_training_on_gpu" > $OUT/gpu_tests.log 2>&1; echo "tests rc=$? t=$SECONDS"
grep -vE "$F" $OUT/gpu_tests.log | grep -E "FAILED|ERROR|passed|failed|s call" | tail -14
wait
sed 's/                data.start_epoch(epoch + 1)/                data.set_epoch(epoch + 1)  # bench: old behaviour/' train.py > train_noearly.py
grep -c "bench: old behaviour" train_noearly.py
timeout -k 5 150 python3 train.py /tmp/fake2 -j 8 --data-backend gpu -a resnet50 -b 256 --opt-level O1 --compile True --compile-mode reduce-overhead --epochs 2 --steps-per-epoch 20 --lr-steps 30 --overwrite --output-dir /tmp/warm > $OUT/warm.log 2>&1; echo warm rc=$? t=$SECONDS
grep -vE "$F" $OUT/warm.log | grep -E "=> input|Epoch: \[1\]|Prec@1 [0-9.]+ Prec" | tail -5
