#!/bin/bash
# On the GPU machine, from the repository root, with exllamav3's source tree carried in
# .exl3src/ (an ignored folder: add /.exl3src/ to .git/info/exclude), made here with
#   mkdir .exl3src && git -C <exllamav3 clone> archive HEAD exllamav3 | tar -x -C .exl3src
# (2026-11-29: commit 4f8ad01, v1.4.1). Then, there:
#   bash tools/exl3_groundtruth/run.sh
# Writes the test vectors and a log to $OUT; copy the npz files to tests/fixtures/exl3/.
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvcc --version | tail -2
python3 tools/exl3_groundtruth/make_vectors.py .exl3src "$OUT" 2>&1 | tee "$OUT/groundtruth_log.txt"
