#!/bin/bash
# On the GPU machine, from the repository root, with exllamav3's source tree carried in
# .exl3src/ (git archive of turboderp-org/exllamav3, folder exllamav3/):
#   bash tools/exl3_groundtruth/run.sh
# Writes the test vectors and a log to $OUT; copy the npz files to tests/fixtures/exl3/.
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvcc --version | tail -2
python3 tools/exl3_groundtruth/make_vectors.py .exl3src "$OUT" 2>&1 | tee "$OUT/groundtruth_log.txt"
