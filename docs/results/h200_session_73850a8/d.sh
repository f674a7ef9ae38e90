# call D: nvJPEG under --deterministic, two runs alone, then two at once beside a third decoding run; compare losses.
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=4
[ -d /tmp/fake2 ] || { echo "fresh machine: writing /tmp/fake2"; python3 tools/make_fake_imagenet.py /tmp/fake2 --classes 80 --train-per-class 256 --val-per-class 2 --jobs 14 > /dev/null 2>&1; echo "fake2 t=$SECONDS"; }
COMMON="/tmp/fake2 -a resnet50 -b 256 --opt-level O1 --data-backend gpu --jpeg-decoder cuda --epochs 1 --steps-per-epoch ${DET_STEPS:-30} -p 1 -j 6 --seed 3 --overwrite"
run() { timeout -k 5 150 python3 train.py $COMMON --deterministic --output-dir /tmp/det_$1 > $OUT/det_$1.log 2>&1; echo "$1 rc=$? t=$SECONDS"; }
losses() { grep -oE "Loss [0-9.]+ " $OUT/det_$1.log | awk '{print $2}' > /tmp/loss_$1.txt; wc -l < /tmp/loss_$1.txt; }
run alone1; run alone2
(timeout -k 5 150 python3 train.py $COMMON --output-dir /tmp/det_noise > $OUT/det_noise.log 2>&1; echo "noise rc=$?") &
sleep 8; run beside1 & run beside2 & wait
for r in alone1 alone2 beside1 beside2; do echo "$r steps: $(losses $r)"; done
cmpl() { if cmp -s /tmp/loss_$1.txt /tmp/loss_$2.txt; then echo "$1 == $2"; else echo "$1 != $2 first diff at step $(diff <(cat -n /tmp/loss_$1.txt) <(cat -n /tmp/loss_$2.txt) | grep -m1 -oE '^< +[0-9]+' | tr -dc 0-9)"; fi; }
cmpl alone1 alone2; cmpl beside1 beside2; cmpl alone1 beside1; cmpl alone1 beside2
grep -E "Prec@1" $OUT/det_alone1.log | tail -1; grep -m1 "=> input" $OUT/det_alone1.log
