#!/usr/bin/env bash
# Run on the development machine, from the repository root, after the last code commit and before
# the device calls. Makes before/ (the code before TakeAhead) and the wheels the device has no index
# for; both are git-ignored here (.git/info/exclude) and named in each call's carry: ["before", ".whl"].
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for folder in /before/ /.whl/; do
    grep -qxF "$folder" .git/info/exclude || echo "$folder" >> .git/info/exclude
done
rm -rf before && mkdir before && git archive 943d1cc | tar -x -C before
# pytest-xdist for the GPU suite; nvImageCodec + nvJPEG for its 8 hardware-decoder cases (28 MB)
mkdir -p .whl
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl pytest-xdist execnet
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
    "nvidia-nvimgcodec-cu13==0.9.0.20" nvidia-nvjpeg
du -sh before .whl
