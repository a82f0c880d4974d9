#!/usr/bin/env python
"""Django's command-line utility for the control plane.

`platform/` is a source root, not a package: a top-level `platform` package would shadow the
standard library's `platform` module (see docs/architecture.md), so it goes on sys.path here.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT))


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
