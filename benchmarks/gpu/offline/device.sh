#!/usr/bin/env bash
# The GPU bench on a machine that reaches no package registry (the lent GPU machine), run ON it
# from the repository root. Elsewhere, `pip install vllm` and `python -m benchmarks.gpu.run` suffice.
#
#   bash benchmarks/gpu/offline/device.sh receive .gpN     # keep one carried wheel part in /tmp/parts
#   bash benchmarks/gpu/offline/device.sh bench [ARGS...]  # install once, then benchmarks.gpu.run ARGS
#   bash benchmarks/gpu/offline/device.sh fleet [ARGS...]  # install once, then benchmarks.fleet --profile h200 ARGS
#
# Wheel parts come from benchmarks/gpu/offline/prepare.sh, one device call per part (a call carries
# at most 64 MiB). A warm machine keeps /tmp between calls, not the carried folders; so each call
# must follow the previous one within the machine's 30 s warm window. `bench` gives the run a
# deadline of 565 s from the call's start (a call runs at most 600 s; --deadline-s in ARGS wins):
# one stage from a cold start fits (engines start in ~170-300 s); run the next stage
# (`bench --stage profiles`) in the next call, within the warm window, so the wheels stay installed
# and the compile caches are reused.
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
  bench|fleet)
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
    export PATH="/tmp/site/bin:$PATH"
    python3 -c 'import vllm, torch, django, celery; print("vllm", vllm.__version__, "torch", torch.__version__, "django", django.__version__)'
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
    if [ "$cmd" = fleet ]; then
      # Four workers sharing the GPU, each its share of memory (benchmarks/fleet.py ``gpu_plan``). The
      # run outlasts a 600 s call when started with setsid: its results stay in /tmp/gpubench/fleet.
      python3 -m benchmarks.fleet --profile h200 --out /tmp/gpubench/fleet "$@"
      if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then cp -r /tmp/gpubench/fleet "$OUT/"; fi
    else
      python3 -m benchmarks.gpu.run --deadline-s "$(( 565 - ($(date +%s) - t0) ))" "$@"
    fi
    ;;
  *)
    echo "usage: $0 receive DIR | bench [--stage platform|profiles|capacity|adapters ...] [--levels N,N] [--rounds N]" >&2
    echo "       $0 fleet [--quick] [--workers N] [--no-bare] [--workloads shared,distinct]" >&2
    exit 2
    ;;
esac
