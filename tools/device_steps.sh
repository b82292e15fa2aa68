#!/bin/bash
# Several commands in one call of the device tool (whose machine goes back after 30 s idle, so
# each call should do all it can): installs the MLX CUDA pack (.dev/, from
# ../shared/tools/mlx-cuda-pack.sh, carried with the call), then runs each command under
# `timeout`, cut to what is left of D seconds (default 540), skipping those that would get less
# than 20 s. Each command's output goes to $OUT/step-<n>.log, its last TAIL lines (default 25) here.
#
#   D=540 bash tools/device_steps.sh "python -m pytest -q -m gpu tests/test_kernels_gpu.py" \
#       "python -m benchmarks.slice_decode --contexts 512 --variants dsv4 --ab kernel_moe_dp4a=on --out \$OUT"
#
# KC=scratch_gpu/kc: the kernel cache (DSV4_KERNEL_CACHE) lives in that directory, unpacked
# first from $KC.tgz when the call carried one; the builds the commands added come back as
# $OUT/kc-new.tgz (only those: the whole cache outgrew the 16 MiB a returned file may have):
# merge them into $KC.tgz before the next call with tools/kernel_cache_merge.sh, so that a
# fresh machine loads the kernels instead of spending ~100 s of NVRTC on the slice's.
start=$(date +%s)
D=${D:-540}
TAIL=${TAIL:-25}
OUT=${OUT:-/tmp/device-steps}
mkdir -p "$OUT"
bash .dev/install.sh > "$OUT/install.log" 2>&1 || { echo "install failed:"; tail -5 "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
if [ -n "$KC" ]; then
  mkdir -p "$KC" && export DSV4_KERNEL_CACHE=$(realpath "$KC")
  [ -f "$KC.tgz" ] && tar xzf "$KC.tgz" -C "$KC"
  stamp=$(mktemp)   # files newer than this are this call's builds (tar keeps the archive's times)
fi
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
n=0
for cmd in "$@"; do
  n=$((n + 1))
  left=$((D - ($(date +%s) - start)))
  if [ "$left" -lt 20 ]; then echo "=== step $n skipped ($left s left): $cmd"; continue; fi
  echo "=== step $n ($left s left): $cmd"
  timeout $((left - 5)) bash -c "$cmd" > "$OUT/step-$n.log" 2>&1
  echo "rc $?"
  tail -n "$TAIL" "$OUT/step-$n.log"
done
if [ -n "$KC" ]; then
  (cd "$KC" && find . -type f -newer "$stamp") > "$OUT/kc-new.list"
  if [ -s "$OUT/kc-new.list" ]; then
    tar czf "$OUT/kc-new.tgz" -C "$KC" -T "$OUT/kc-new.list" \
      && echo "kernel cache: $(wc -l < "$OUT/kc-new.list") new builds back as \$OUT/kc-new.tgz"
  fi
  rm -f "$OUT/kc-new.list"
fi
