# stop 24, call F: the cuda decoder's runs differ at epoch 1 step 3 (hardware's never): threads, syncs, workers.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=2 IMAGENET_AMP_CACHE=/tmp/cache
mkdir -p /tmp/v
python3 - <<'PY'
import os, shutil
src = open("utils/gpu_batches.py").read()
def variant(name, old, new):
    assert old in src, name
    d = f"/tmp/v/{name}"
    shutil.copytree(".", d, ignore=shutil.ignore_patterns(".git", ".whl", ".bench", "docs"))
    open(f"{d}/utils/gpu_batches.py", "w").write(src.replace(old, new))
t = "        self.threads = (2 if decoder.cuda else 0) if threads is None else threads\n"
variant("t0", t, t.replace("(2 if", "(0 if"))
variant("t1", t, t.replace("(2 if", "(1 if"))
d = "            pictures = self.decode(packed)\n"
variant("syncdec", d, d + "            torch.cuda.synchronize()\n")
r = "            images, targets = self._finish(packed, pictures)\n"
variant("syncres", r, r + "            torch.cuda.synchronize()\n")
variant("main", t, t)
PY
COMMON="--deterministic --opt-level O2 --data-backend gpu -a resnet18 --image-size 32 -p 1 -b 16 --steps-per-epoch 4 --epochs 3 --jpeg-decoder cuda"
(cd /tmp/v/main && python3 train.py $COMMON -j 0 --epochs 1 --output-dir /tmp/d/first > /dev/null 2>&1); echo "digits written t=$SECONDS"
for v in t0 t1 syncdec syncres main main:2; do for i in 1 2 3; do
  code=${v%%:*}; j=0; [ "$code" != "$v" ] && j=${v##*:}
  (cd /tmp/v/$code && python3 train.py $COMMON -j $j --output-dir /tmp/d/${code}_${j}_$i > $OUT/${code}_j${j}_$i.log 2>&1) &
done; done
wait; echo "runs done t=$SECONDS"
for f in $OUT/*_1.log; do b=${f%_1.log}; n=$(grep -cE "^Epoch" $f); h="$(for i in 1 2 3; do grep -E "^Epoch" ${b}_$i.log | cut -f1,4,5 | md5sum | cut -c1-8; done | xargs)"; echo "$(basename $b) lines=$n hashes: $h"; done
grep -l Traceback $OUT/*.log | head
