# call H2: where the gpu backend's stalls come from: random tensors; the gpu backend with host timers on
# its threads (devcalls/probe_threads.py) at -j 8, the same with 4 batches resampled ahead, and -j 12.
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
F="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
nvidia-smi --query-gpu=name --format=csv,noheader; git log -1 --format=%h 2>/dev/null
[ -d /tmp/fake2 ] || { python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 --val-per-class 2 --jobs 16 > /dev/null 2>&1; echo "fake2 t=$SECONDS"; }
COMMON="-a resnet50 -b 256 --opt-level O1 --compile True --compile-mode reduce-overhead --prof 100 --prof-steps 60"
GPU="$COMMON --data-backend gpu --jpeg-decoder cuda /tmp/fake2"
run() { name=$1; shift; timeout -k 5 130 "$@" > $OUT/$name.log 2>&1; echo "$name rc=$? t=$SECONDS"; }
run synthetic python3 profile.py $COMMON synthetic
run probe_j8 python3 devcalls/probe_threads.py $OUT/probe_j8.json $GPU -j 8
export PROBE_AHEAD=4; run probe_j8_ahead4 python3 devcalls/probe_threads.py $OUT/probe_j8_ahead4.json $GPU -j 8; unset PROBE_AHEAD
run probe_j12 python3 devcalls/probe_threads.py $OUT/probe_j12.json $GPU -j 12
for f in synthetic probe_j8 probe_j8_ahead4 probe_j12; do echo "== $f"; grep -vE "$F" $OUT/$f.log | sed -n '/=> phases/,$p' | grep -v "^phase\|host-to-device\|sum of phases\|^precision\|peak GPU"; done
