"""The package's licence: the text ships with the source and inside every wheel built from it."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def metadata() -> configparser.SectionProxy:
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    return parser["metadata"]


def test_the_license_file_is_the_apache_license_the_package_declares():
    text = (REPO / "LICENSE").read_text()
    meta = metadata()
    assert meta["license"] == "Apache-2.0"
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    sections = [f"{n}. {title}" for n, title in enumerate(
        ["Definitions", "Grant of Copyright License", "Grant of Patent License",
         "Redistribution", "Submission of Contributions", "Trademarks",
         "Disclaimer of Warranty", "Limitation of Liability",
         "Accepting Warranty or Additional Liability"], start=1)]  # fmt: skip
    for section in sections:
        assert section in text, section
    assert "END OF TERMS AND CONDITIONS" in text
    assert meta["license_files"].split() == ["LICENSE"]


def test_a_wheel_built_from_the_source_carries_the_license(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "gpuhedge_celery", src / "gpuhedge_celery",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")
                    or n.endswith(".dist-info/LICENSE")]  # fmt: skip
        assert len(licenses) == 1, names
        assert z.read(licenses[0]).decode() == (REPO / "LICENSE").read_text()
        [meta] = [n for n in names if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
    assert "License-File: LICENSE" in lines
