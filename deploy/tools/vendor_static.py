#!/usr/bin/env python3
"""Vendor the console's front-end libraries (Chart.js, htmx) into its static files.

The console never loads anything from the internet: the browser gets these files from our own
origin (whitenoise under gunicorn). This script is the only place they come from. For each pinned
npm package it gets the release tarball (``npm pack`` when npm is installed, else a plain HTTPS
download from registry.npmjs.org), checks the tarball against the pinned SRI integrity (sha512),
and copies the named files into ``platform/console/static/console/vendor/`` with a ``VENDORED.json``
manifest (package, version, integrity, license, sha256 of each file written). A trailing
``//# sourceMappingURL=`` comment is dropped: the maps are not vendored (about 1 MB), and Django's
manifest storage (collectstatic in the web image) fails on a reference to a missing file.

The files it writes are committed, so a checkout works offline; run the script again to upgrade
(change VERSION and INTEGRITY below: `npm view <pkg>@<version> dist.integrity`) or with ``--check``
to verify that the committed files are exactly what the pinned packages hold (CI does this).

Usage: python deploy/tools/vendor_static.py [--check] [--dest DIR]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = REPO_ROOT / "platform" / "console" / "static" / "console" / "vendor"
REGISTRY = "https://registry.npmjs.org"
SOURCE_MAP_COMMENT = re.compile(rb"\n?//# sourceMappingURL=\S+\s*$")


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    integrity: str  # npm's dist.integrity of the tarball
    license: str
    files: dict[str, str]  # path inside the tarball (under package/) -> file name in dest

    @property
    def tarball_url(self) -> str:
        return f"{REGISTRY}/{self.name}/-/{self.name.split('/')[-1]}-{self.version}.tgz"


PACKAGES = [
    Package(
        name="chart.js",
        version="4.5.1",
        integrity="sha512-GIjfiT9dbmHRiYi6Nl2yFCq7kkwdkp1W/lp2J99rX0yo9tgJGn3lKQATztIjb5tVtevcBtIdICNWqlq5+E8/Pw==",
        license="MIT",
        files={"dist/chart.umd.min.js": "chart.umd.min.js", "LICENSE.md": "chart.js.LICENSE.md"},
    ),
    Package(
        name="htmx.org",
        version="2.0.9",
        integrity="sha512-Vd8ZlGSshz2W2ej+gNpMqxX2PM0dfOn4lRgkTXgCT+cqZE/GwBQoYm3zGvlqf+hHXYCMYmmgae33m4/RPdTS0Q==",
        license="0BSD",
        files={"dist/htmx.min.js": "htmx.min.js"},
    ),
]


class VendorError(Exception):
    pass


def _fetch_tarball(package: Package) -> bytes:
    spec = f"{package.name}@{package.version}"
    npm = shutil.which("npm")
    if npm:
        with tempfile.TemporaryDirectory() as tmp:
            result = subprocess.run(
                [npm, "pack", spec, "--json", "--pack-destination", tmp],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            if result.returncode == 0:
                filename = json.loads(result.stdout)[0]["filename"]
                return (Path(tmp) / filename).read_bytes()
            print(f"npm pack {spec} failed, downloading the tarball instead:\n{result.stderr}", file=sys.stderr)
    with urllib.request.urlopen(package.tarball_url, timeout=120) as response:  # noqa: S310 (fixed https URL)
        return response.read()


def _check_integrity(package: Package, data: bytes) -> None:
    algorithm, _, expected = package.integrity.partition("-")
    actual = base64.b64encode(hashlib.new(algorithm, data).digest()).decode()
    if actual != expected:
        raise VendorError(f"{package.name}@{package.version}: tarball integrity {algorithm}-{actual} != pinned")


def _extract(package: Package, data: bytes) -> dict[str, bytes]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for inner, name in package.files.items():
            member = tar.extractfile(f"package/{inner}")
            if member is None:
                raise VendorError(f"{package.name}@{package.version} has no file {inner}")
            body = member.read()
            out[name] = SOURCE_MAP_COMMENT.sub(b"\n", body) if name.endswith(".js") else body
    return out


def vendor(dest: Path, *, check: bool) -> int:
    manifest = {}
    problems = []
    contents: dict[str, bytes] = {}
    for package in PACKAGES:
        data = _fetch_tarball(package)
        _check_integrity(package, data)
        files = _extract(package, data)
        contents.update(files)
        manifest[package.name] = {
            "version": package.version,
            "integrity": package.integrity,
            "license": package.license,
            "files": {name: hashlib.sha256(body).hexdigest() for name, body in files.items()},
        }
    contents["VENDORED.json"] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    for name, body in contents.items():
        target = dest / name
        if check:
            if not target.exists() or target.read_bytes() != body:
                problems.append(f"{target} differs from the pinned package")
        else:
            dest.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
            print(f"wrote {target.relative_to(REPO_ROOT) if target.is_relative_to(REPO_ROOT) else target}")
    for problem in problems:
        print(problem, file=sys.stderr)
    if check and not problems:
        print(f"{dest}: vendored files match the pinned packages")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the committed files, write nothing")
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = parser.parse_args()
    try:
        return vendor(args.dest.resolve(), check=args.check)
    except (VendorError, OSError) as exc:
        print(f"vendor_static: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
