# call F: where the gpu backend's last 7 % goes: profile.py phase tables (data wait vs step) on the
# gpu backend and on random tensors, both O1 + reduce-overhead, same machine start.
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
F="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
nvidia-smi --query-gpu=name --format=csv,noheader
[ -d /tmp/fake2 ] || { python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 --val-per-class 2 --jobs 16 > /dev/null 2>&1; echo "fake2 t=$SECONDS"; }
COMMON="-a resnet50 -b 256 -j 8 --opt-level O1 --compile True --compile-mode reduce-overhead --prof 50 --prof-steps 20"
timeout -k 5 150 python3 profile.py $COMMON --data-backend gpu --jpeg-decoder cuda /tmp/fake2 > $OUT/prof_gpu.log 2>&1; echo "gpu rc=$? t=$SECONDS"
timeout -k 5 120 python3 profile.py $COMMON synthetic > $OUT/prof_synthetic.log 2>&1; echo "synthetic rc=$? t=$SECONDS"
for f in prof_gpu prof_synthetic; do echo "== $f"; grep -vE "$F" $OUT/$f.log | sed -n '/=> phases/,$p' | head -16; done
