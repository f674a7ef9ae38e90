# Prepared 2026-12-07 (fourth session), not yet run: the cuDNN-fused Bottleneck with the two
# pieces the third/fourth rounds left unfused. Run from the repository root with the cuDNN frontend wheel in .whl/ (carried).
#  1. the C++ extension (bench/fused/dgrad_dbn.cpp: cuDNN's DgradDreluBNBwdWeight) builds;
#  2. every ResNet-50 block shape: eager, torch.compile, and the fused block with
#     (a) the compiled fallback only (the fourth round's best), (b) + --dgrad-dbn,
#     (c) + --mask-bn3 (relu + bn3 backward as one cuDNN graph over a bit mask), (d) (c) MSB first.
# Each block's gradient check prints beside autocast's: a wrong formula or bit order shows there.
set -u
T0=$(date +%s)
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/nvidia_cudnn_frontend*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 240 python3 bench/fused/build.py --version > $OUT/build.log 2>&1; echo "build rc=$? at $(( $(date +%s) - T0 )) s"; tail -4 $OUT/build.log
F="bench/fused_bottleneck.py --top 8 --iters 10"
timeout 150 python3 $F --compiled-fallback > $OUT/a_compiled_fallback_all.txt 2>&1; echo "a rc=$? at $(( $(date +%s) - T0 )) s"; grep "fwd+bwd\|pieces\|16 bottlenecks\|vs " $OUT/a_compiled_fallback_all.txt | tail -14
timeout 90 python3 $F --no-compile --compiled-fallback --dgrad-dbn > $OUT/b_dgrad_dbn.txt 2>&1; echo "b rc=$? at $(( $(date +%s) - T0 )) s"; grep "rel. error\|fwd+bwd\|pieces\|16 bottlenecks\|failed\|Error" $OUT/b_dgrad_dbn.txt | tail -30
timeout 90 python3 $F --no-compile --compiled-fallback --dgrad-dbn --mask-bn3 > $OUT/c_mask.txt 2>&1; echo "c rc=$? at $(( $(date +%s) - T0 )) s"; grep "rel. error\|fwd+bwd\|pieces\|16 bottlenecks\|failed\|Error" $OUT/c_mask.txt | tail -30
timeout 60 python3 $F --no-compile --compiled-fallback --mask-bn3 --mask-msb --blocks layer1.0 > $OUT/d_mask_msb.txt 2>&1; echo "d rc=$? at $(( $(date +%s) - T0 )) s"; grep "rel. error\|fwd+bwd\|pieces" $OUT/d_mask_msb.txt | tail -6
echo "all done at $(( $(date +%s) - T0 )) s"
