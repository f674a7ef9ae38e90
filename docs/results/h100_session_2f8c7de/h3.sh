# call H3: variants of the gpu backend's threads and streams, each a profile.py window with host timers
# (devcalls/probe_threads.py): baseline, GIL switch interval 0.5 ms, resampling stream at normal priority,
# the hardware decoder (nvImageCodec) on its default and on a high-priority decode stream; random tensors.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_nv*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
F="WARNING|nvjpeg2k|nvtiff|nvTIFF|JPEG2000|^Note|\[ERROR\]"
nvidia-smi --query-gpu=name --format=csv,noheader
[ -d /tmp/fake2 ] || { python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 --val-per-class 2 --jobs 16 > /dev/null 2>&1; echo "fake2 t=$SECONDS"; }
COMMON="-a resnet50 -b 256 --opt-level O1 --compile True --compile-mode reduce-overhead --prof 100 --prof-steps 60"
GPU="$COMMON --data-backend gpu -j 8 /tmp/fake2"
run() { name=$1; shift; timeout -k 5 110 "$@" > $OUT/$name.log 2>&1; echo "$name rc=$? t=$SECONDS"; }
probe() { name=$1; shift; run $name python3 devcalls/probe_threads.py $OUT/$name.json $GPU "$@"; }
run synthetic python3 profile.py $COMMON synthetic
probe cuda --jpeg-decoder cuda
export PROBE_SWITCH=0.0005; probe cuda_switch05 --jpeg-decoder cuda; unset PROBE_SWITCH
export PROBE_RESAMPLE_PRIORITY=0; probe cuda_resample_prio0 --jpeg-decoder cuda; unset PROBE_RESAMPLE_PRIORITY
probe hardware --jpeg-decoder hardware
export PROBE_DECODE_PRIORITY=-1; probe hardware_decode_prio1 --jpeg-decoder hardware
export PROBE_HW_OPTIONS=":fancy_upsampling=0"; probe hardware_prio1_simple --jpeg-decoder hardware; unset PROBE_DECODE_PRIORITY PROBE_HW_OPTIONS
for f in synthetic cuda cuda_switch05 cuda_resample_prio0 hardware hardware_decode_prio1 hardware_prio1_simple; do echo "== $f"; grep -vE "$F" $OUT/$f.log | grep -E "^probe:|^measured step|^throughput|^data wait|^host taking|^  decode|resample_ahead|queue_get +Main|loader_next|Error|error"; done
