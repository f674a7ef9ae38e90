# call G: the hardware-decoder GPU tests, with nvImageCodec 0.9 + nvJPEG carried as wheels (skipped without them).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
F="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import nvidia.nvimgcodec as n; print('nvimgcodec', getattr(n, '__version__', '?'))"
timeout -k 5 ${SUITE_CAP:-200} python3 -m pytest -v -n 4 -m gpu tests -k "hardware or deterministic" -p no:cacheprovider > $OUT/gpu_hardware.log 2>&1; echo "rc=$? t=$SECONDS"
grep -vE "$F" $OUT/gpu_hardware.log | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" | tail -30
