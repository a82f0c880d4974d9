"""The GPU bench's wheel list follows requirements.txt (benchmarks/gpu/offline/wheel_closure.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "offline"))
import wheel_closure  # noqa: E402


def test_requirements_are_read_as_the_device_sees_them():
    text = (
        "# comment\nDjango==5.2.19\npsycopg[binary,pool]==3.3.9  # with extras\n\n-r other.txt\n"
        'uvloop==0.22.1; sys_platform != "win32"\npywin32==311; sys_platform == "win32"\n'
        "uvicorn-worker==0.4.0 \\\n    --hash=sha256:abc\n"
    )
    assert wheel_closure.requirements_in(text) == [
        "Django==5.2.19", "psycopg[binary,pool]==3.3.9", "uvloop==0.22.1", "uvicorn-worker==0.4.0",
    ]  # fmt: skip


def test_every_line_of_requirements_txt_is_read():
    root = Path(__file__).resolve().parents[2]
    lines = [line for line in (root / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]  # fmt: skip
    assert len(wheel_closure.requirements_in((root / "requirements.txt").read_text())) == len(lines)


def test_prune_removes_wheels_no_longer_required(tmp_path):
    for name in ("django-5.2.19-py3-none-any.whl", "django-5.2.18-py3-none-any.whl", ".complete"):
        (tmp_path / name).write_text("x")
    removed = wheel_closure.prune(str(tmp_path), {str(tmp_path / "django-5.2.19-py3-none-any.whl")})
    assert removed == ["django-5.2.18-py3-none-any.whl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".complete", "django-5.2.19-py3-none-any.whl"]
