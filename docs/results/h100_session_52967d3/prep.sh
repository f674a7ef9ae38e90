#!/usr/bin/env bash
# As run on 2026-12-05 from docs/results/pending_gpu_calls/ (paths changed to this folder afterwards).
# Run on the development machine, from the repository root, before the device calls below.
# Makes the two other copies of the code the benchmark runs beside this one, and the wheels the
# device has no index for. All three folders are git-ignored here (.git/info/exclude) and must be
# named in each call's carry: ["before", "depth3", ".whl"].
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for folder in /before/ /depth3/ /.whl/; do
    grep -qxF "$folder" .git/info/exclude || echo "$folder" >> .git/info/exclude
done
# before/: the code before TakeAhead (the batch taken ahead of the print step's sync)
rm -rf before && mkdir before && git archive 943d1cc | tar -x -C before
# depth3/: this code with a third optimizer step queued ahead of the GPU (RunAhead depth 3, not 2)
rm -rf depth3 && mkdir depth3 && git archive HEAD | tar -x -C depth3
patch -d depth3 -p1 < docs/results/h100_session_52967d3/depth3.patch
# pytest-xdist for the GPU suite; nvImageCodec + nvJPEG for its 8 hardware-decoder cases (28 MB)
mkdir -p .whl
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl pytest-xdist execnet
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
    "nvidia-nvimgcodec-cu13==0.9.0.20" nvidia-nvjpeg
du -sh before depth3 .whl
