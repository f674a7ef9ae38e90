# Probe call (not product; run from the repository root with the frontend wheel in .whl/): the cuDNN-fused Bottleneck with dgrad + drelu + dbn_weight as one cuDNN
# graph through a ctypes library, against torch.compile and the fused block without it.
set -u
T0=$(date +%s)
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, torchvision; print(torch.__version__, torchvision.__version__, torch.backends.cudnn.version())"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/nvidia_cudnn_frontend*.whl > /dev/null 2>&1
# FE_INCLUDE: the cuDNN frontend wheel's include/ folder, carried (unzip .whl/nvidia_cudnn_frontend*.whl)
export PYTHONPATH=/tmp/site DD_BUILD=/tmp/dgrad_dbn FE_INCLUDE=${FE_INCLUDE:-.devcall/include}
timeout 200 python3 bench/fused/dgrad_dbn.py --build > $OUT/build.log 2>&1; echo "build rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/build.log
timeout 60 python3 -X faulthandler bench/fused/dgrad_dbn.py --check > $OUT/check.log 2>&1; echo "check rc=$? at $(( $(date +%s) - T0 )) s"; tail -5 $OUT/check.log
F="-X faulthandler bench/fused_bottleneck.py --iters 10"
timeout 100 python3 $F --no-compile --compiled-fallback --mask-bn3 --dgrad-dbn --blocks layer1.1 > $OUT/b0_one_block.txt 2>&1; echo "b0 rc=$? at $(( $(date +%s) - T0 )) s"; tail -8 $OUT/b0_one_block.txt
timeout 170 python3 $F --compiled-fallback --mask-bn3 > $OUT/a_mask_compile.txt 2>&1; echo "a rc=$? at $(( $(date +%s) - T0 )) s"; grep "fwd+bwd\|pieces\|16 bottlenecks\|vs \|failed" $OUT/a_mask_compile.txt | tail -14
timeout 110 python3 $F --no-compile --compiled-fallback --mask-bn3 --dgrad-dbn > $OUT/b_dgrad_dbn_AF.txt 2>&1; echo "b rc=$? at $(( $(date +%s) - T0 )) s"; grep "rel. error\|fwd+bwd\|pieces\|16 bottlenecks\|failed\|Error" $OUT/b_dgrad_dbn_AF.txt | tail -30
DD_HEUR=0 timeout 110 python3 $F --no-compile --compiled-fallback --mask-bn3 --dgrad-dbn > $OUT/c_dgrad_dbn_A.txt 2>&1; echo "c rc=$? at $(( $(date +%s) - T0 )) s"; grep "fwd+bwd\|pieces\|16 bottlenecks\|failed\|Error" $OUT/c_dgrad_dbn_A.txt | tail -14
echo "all done at $(( $(date +%s) - T0 )) s"
