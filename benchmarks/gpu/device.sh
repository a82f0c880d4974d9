#!/usr/bin/env bash
# Runs ON the lent GPU machine, from the repository root (the device tool's working directory).
#
#   bash benchmarks/gpu/device.sh receive .gpN       # keep one carried wheel part in /tmp/parts
#   bash benchmarks/gpu/device.sh bench [STAGE...]   # install once, then measure (default: platform)
#
# Wheel parts come from benchmarks/gpu/prepare.sh, one device call per part (a call carries at most
# 64 MiB). A warm machine keeps /tmp between calls, not the carried folders; so each call must follow
# the previous one within the machine's 30 s warm window. Stages: platform, profiles, compare, fusions,
# variants, capacity, adapters, interval, turnaround, cudagraph (benchmarks/gpu/run.py). One call of about 600 s runs one stage from a
# cold start (engines start in ~170-300 s, then measure one at a time); run the next stage in the next
# call, within the 30 s warm window, so the wheels stay installed and the compile caches are reused.
set -euo pipefail
t0=$(date +%s)
cmd=${1:-bench}
shift || true
case "$cmd" in
  receive)
    mkdir -p /tmp/parts
    cp "$1"/* /tmp/parts/
    ls -la /tmp/parts
    ;;
  bench)
    if [ ! -f /tmp/site/.installed ]; then
      started=$(date +%s)
      rm -rf /tmp/wh && mkdir -p /tmp/wh
      cat /tmp/parts/p* | tar x -C /tmp/wh
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/wh/*.whl
      touch /tmp/site/.installed
      echo "installed $(ls /tmp/wh/*.whl | wc -l) wheels in $(( $(date +%s) - started )) s"
    fi
    # The wheels, then the source roots (what `make venv`'s .pth file does on a development machine).
    export PYTHONPATH="/tmp/site:$PWD/platform:$PWD"
    export PATH="/tmp/site/bin:$PATH"  # the wheels' commands (py-spy, for BENCH_PROFILE_WORKER_HZ)
    python3 -c 'import vllm, torch, django, celery; print("vllm", vllm.__version__, "torch", torch.__version__, "django", django.__version__)'
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
    # The GPU's clocks, power and load every second: a level that slowed down for every stream at
    # once can then be told apart from a slowdown of the platform's own.
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
      --format=csv -l 1 > "${OUT:-/tmp}/gpu-clocks.csv" 2>/dev/null &
    trap 'kill %1 2>/dev/null || true' EXIT
    stages=()
    [ $# -gt 0 ] || set -- platform
    for s in "$@"; do stages+=(--stage "$s"); done
    python3 -m benchmarks.gpu.run "${stages[@]}" --deadline-s "$(( ${BENCH_BUDGET_S:-565} - ($(date +%s) - t0) ))"
    ;;
  *)
    echo "usage: $0 receive DIR | bench [platform|profiles|compare|variants|fusions|capacity|adapters|interval|turnaround|cudagraph ...]" >&2
    exit 2
    ;;
esac
