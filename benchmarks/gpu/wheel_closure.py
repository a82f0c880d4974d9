"""Download the wheels a requirement needs on the lent GPU machine that its image lacks.

    WHEEL_DIR=DIR python benchmarks/gpu/wheel_closure.py 'vllm==0.26.0' [names to skip...]

Walks the requirement's dependencies (CPython 3.12, manylinux x86_64 markers), skipping what the
device image already has (KINDS.md's package list, below) and the names given after the
requirement, and downloads one binary wheel of each into WHEEL_DIR. Adapted from the shared
``../shared/gpu/wheel_closure.py`` so that a clean checkout has it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What the device image ('cuda', read 2026-11-17) holds; see the device tool's KINDS.md.
DEVICE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
"""
MARKER_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 36, 37, 38, 39)]
PLATFORMS += ["manylinux2014_x86_64", "linux_x86_64", "any"]


def _download(spec: str, out: str) -> subprocess.CompletedProcess:
    platform_args = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return subprocess.run(
        ["pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", *platform_args, "-d", out, spec],
        capture_output=True, text=True, env=dict(os.environ, PIP_CONSTRAINT=""),
    )  # fmt: skip


def _needed(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate(dict(MARKER_ENV, extra=extra)) for extra in {"", *extras})


def _metadata(wheel: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return archive.read(name).decode()


def closure(root: str, skip: set[str], out: str) -> dict[str, str | None]:
    have = {canonicalize_name(name) for name in DEVICE_PACKAGES.split()} | skip
    queue, seen = [Requirement(root)], {}
    os.makedirs(out, exist_ok=True)
    while queue:
        requirement = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if name in seen or name in have:
            continue
        spec = f"{requirement.name}{requirement.specifier}"
        before = set(os.listdir(out))
        result = _download(spec, out)
        new = set(os.listdir(out)) - before
        candidates = list(new) or [f for f in os.listdir(out) if canonicalize_name(re.split(r"-\d", f)[0]) == name]
        if result.returncode != 0 or not candidates:
            print("FAIL", spec, result.stderr.strip().splitlines()[-1:])
            seen[name] = None
            continue
        wheel = os.path.join(out, candidates[0])
        seen[name] = wheel
        for line in _metadata(wheel).splitlines():
            if line.startswith("Requires-Dist:"):
                dependency = Requirement(line.split(":", 1)[1].strip())
                if _needed(dependency, set(requirement.extras)):
                    queue.append(dependency)
    return seen


def main() -> int:
    skip = {canonicalize_name(name) for name in sys.argv[2:]}
    for wheel in closure(sys.argv[1], skip, os.environ.get("WHEEL_DIR", "wheels")).values():
        if wheel:
            print(f"{os.path.getsize(wheel) / 1e6:8.1f} MB  {os.path.basename(wheel)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
