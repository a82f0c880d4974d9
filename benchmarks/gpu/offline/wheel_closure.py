"""Download the wheels requirements need on the lent GPU machine that its image lacks.

    WHEEL_DIR=DIR python benchmarks/gpu/offline/wheel_closure.py 'vllm==0.26.0' [names to skip...]
    WHEEL_DIR=DIR python benchmarks/gpu/offline/wheel_closure.py --prune -r requirements.txt 'vllm==0.26.0' [skip...]

Walks each requirement's dependencies (CPython 3.12, manylinux x86_64 markers), skipping what the
device image already has (KINDS.md's package list, below) and the names given after the first
requirement, and downloads one binary wheel of each into WHEEL_DIR. ``-r FILE`` (repeatable) adds
every requirement a pip requirements file lists at the time it runs (comments, options and lines
whose markers do not hold on the device are left out), so a dependency added to requirements.txt
travels without editing this script. ``--prune`` then deletes the wheels in WHEEL_DIR that are no
longer part of the closure (an older pin left behind would put two versions in one install).
Adapted from the shared ``../shared/gpu/wheel_closure.py`` so that a clean checkout has it.
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


def closure(roots: str | list[str], skip: set[str], out: str) -> dict[str, str | None]:
    """One wheel per name for ``roots`` and everything they need (breadth first: the roots' own pins
    win over a looser requirement of the same name found deeper)."""
    have = {canonicalize_name(name) for name in DEVICE_PACKAGES.split()} | skip
    queue, seen = [Requirement(root) for root in ([roots] if isinstance(roots, str) else roots)], {}
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


def requirements_in(text: str) -> list[str]:
    """The requirements of a pip requirements file's ``text`` that apply on the device: comments,
    blank lines and option lines (``-r``, ``--hash``, ``-c`` ...) dropped, continuation lines joined,
    markers evaluated for CPython 3.12 on Linux x86_64 (a requirement whose marker fails is left out)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*", "", line).strip()
        if not line or line.startswith("-"):
            continue
        line = line.split(" --", 1)[0].strip()  # per-requirement options (--hash=...)
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(dict(MARKER_ENV)):
            requirement.marker = None
            out.append(str(requirement))
    return out


def prune(out: str, keep: set[str]) -> list[str]:
    """Delete the wheels in ``out`` that are not in ``keep`` (paths); returns the deleted names."""
    keep_names = {os.path.basename(path) for path in keep}
    stale = sorted(f for f in os.listdir(out) if f.endswith(".whl") and f not in keep_names)
    for name in stale:
        os.remove(os.path.join(out, name))
    return stale


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    do_prune = "--prune" in args
    args = [a for a in args if a != "--prune"]
    roots: list[str] = []
    while "-r" in args:
        i = args.index("-r")
        with open(args[i + 1]) as handle:
            roots += requirements_in(handle.read())
        del args[i : i + 2]
    roots = args[:1] + roots
    skip = {canonicalize_name(name) for name in args[1:]}
    out = os.environ.get("WHEEL_DIR", "wheels")
    wheels = {wheel for wheel in closure(roots, skip, out).values() if wheel}
    for wheel in sorted(wheels):
        print(f"{os.path.getsize(wheel) / 1e6:8.1f} MB  {os.path.basename(wheel)}")
    if do_prune:
        for name in prune(out, wheels):
            print(f"removed {name} (no longer required)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
