# stop 24, call E (fresh machine): which change makes the deterministic gpu-backend run repeat differently?
# Two runs each of the deterministic test's flags (3 epochs), four codes x two decoders, in parallel.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=2 IMAGENET_AMP_CACHE=/tmp/cache
python3 - <<'PY'
s = open("train.py").read()
call = "                data.start_epoch(epoch + 1)\n"
assert call in s
open("train_noearly.py", "w").write(s.replace(call, "                data.set_epoch(epoch + 1)\n"))
save = "            path = save(epoch + 1, 0, is_best, lr=trained.lr)\n"
late = s.replace(call, "                pass\n").replace(save, "            if epoch + 1 < args.epochs:\n                data.start_epoch(epoch + 1)\n" + save)
open("train_late.py", "w").write(late)
PY
COMMON="--deterministic --opt-level O2 --data-backend gpu -a resnet18 --image-size 32 -j 0 -p 1 -b 16 --steps-per-epoch 4 --epochs 3"
python3 train.py $COMMON --jpeg-decoder cuda --epochs 1 --output-dir /tmp/d/first > /dev/null 2>&1; echo "digits written t=$SECONDS"
for code in train train_noearly train_late; do for dec in cuda hardware; do for i in 1 2; do
  python3 $code.py $COMMON --jpeg-decoder $dec --output-dir /tmp/d/${code}_${dec}_$i > $OUT/${code}_${dec}_$i.log 2>&1 &
done; done; done
wait; echo "runs done t=$SECONDS"
for code in train train_noearly train_late; do for dec in cuda hardware; do
  a=$(grep -E "^Epoch" $OUT/${code}_${dec}_1.log | cut -f1,4,5 | md5sum | cut -c1-8); b=$(grep -E "^Epoch" $OUT/${code}_${dec}_2.log | cut -f1,4,5 | md5sum | cut -c1-8)
  n=$(grep -cE "^Epoch" $OUT/${code}_${dec}_1.log); first=$(diff <(grep -E "^Epoch" $OUT/${code}_${dec}_1.log | cut -f1,4) <(grep -E "^Epoch" $OUT/${code}_${dec}_2.log | cut -f1,4) | head -2 | tail -1 | cut -c1-60)
  echo "$code $dec lines=$n run1=$a run2=$b $( [ $a = $b ] && echo SAME || echo "DIFFER first: $first")"
done; done
grep -l Traceback $OUT/*.log | head
