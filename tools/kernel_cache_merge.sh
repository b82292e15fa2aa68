#!/bin/bash
# Merge a device call's new kernel builds (device_steps.sh's $OUT/kc-new.tgz) into the kernel
# cache archive the next call carries (default scratch_gpu/kc.tgz; made if missing):
#
#   bash tools/kernel_cache_merge.sh /work/.device/N/kc-new.tgz [scratch_gpu/kc.tgz]
#
# The call's working tree travels within 64 MiB (.dev/ is ~22 MiB of it): past 40 MiB the
# archive says so, and the oldest builds can go (rm the archive; the next calls rebuild it).
set -euo pipefail
new=$1
archive=${2:-scratch_gpu/kc.tgz}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
[ -f "$archive" ] && tar xzf "$archive" -C "$dir"
before=$(find "$dir" -type f | wc -l)
tar xzf "$new" -C "$dir"
mkdir -p "$(dirname "$archive")"
tar czf "$archive.partial" -C "$dir" . && mv "$archive.partial" "$archive"
size=$(du -m "$archive" | cut -f1)
echo "$archive: $(find "$dir" -type f | wc -l) builds ($before before), ${size} MiB"
[ "$size" -le 40 ] || echo "$archive is over 40 MiB: with .dev/ it may not travel (64 MiB a call)"
