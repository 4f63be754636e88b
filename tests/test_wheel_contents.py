"""What a user installs is what a user runs: the wheel carries the package and nothing of the
checkout's test scaffolding (the provider fakes live in ``benchmarks/fakes/``), its runtime
requirements hold no test tool, and the bench that needs a fake says in one line, from a wheel
install, that the fake comes with a source checkout."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# what the build reads, and the checkout's fakes, so the wheel could pick them up if it would
SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "LICENSE")
TREES = ("gpuhedge_celery", "benchmarks")
TEST_TOOLS = {
    "pytest",
    "pytest-timeout",
    "hypothesis",
    "ruff",
    "mypy",
    "types-pyyaml",
    "matplotlib",
    "flower",
    "modal",
    "kubernetes-validate",
    "check-jsonschema",
    "prometheus-client",
    "torch",
    "nvidia-ml-py",
    "uvicorn",
    "cryptography",
}
CHECKOUT_ONLY = {"benchmarks", "tests"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of this checkout (no build artefacts left in the tree)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        shutil.copy2(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in TREES:
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    out = tmp_path_factory.mktemp("wheel")
    argv = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-q",
        "-w",
        str(out),
        str(src),
    ]
    built = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert built.returncode == 0, built.stderr[-2000:]
    (found,) = out.glob("gpuhedge_celery-*.whl")
    return found


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _requirements(wheel: Path) -> tuple[set[str], set[str]]:
    """(runtime requirement names, the ``test`` extra's) from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(zf.read(meta).decode())
    runtime, test = set(), set()
    for requirement in message.get_all("Requires-Dist") or []:
        marker = requirement.split(";", 1)[1] if ";" in requirement else ""
        if "extra ==" not in marker:
            runtime.add(_name(requirement))
        elif re.search(r"extra == ['\"]test['\"]", marker):
            test.add(_name(requirement))
    return runtime, test


def _checkout_imports(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [f"{where}:{node.lineno} {n}" for n in names if n.split(".")[0] in CHECKOUT_ONLY]
    return found


def test_the_wheel_carries_no_provider_fake_and_imports_nothing_of_the_checkout(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        sources = {n: zf.read(n).decode() for n in names if n.endswith(".py")}
    assert "gpuhedge_celery/bench/races.py" in names  # the user's benchmarks stay
    assert "gpuhedge_celery/store/embedded.py" in names
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"gpuhedge_celery"}
    fakes = [n for n in names if n.startswith("gpuhedge_celery/") and "fake" in n.split("/")[-1]]
    assert fakes == []
    assert [hit for n, text in sources.items() for hit in _checkout_imports(text, n)] == []


def test_the_wheels_runtime_requirements_hold_no_test_tool(wheel):
    runtime, test = _requirements(wheel)
    assert {"pytest", "hypothesis"} <= test  # the extra is read: the check below can fail
    assert runtime & (TEST_TOOLS | test) == set()
    assert "fakeredis" in runtime  # the demo's embedded Redis, with no Redis server to install


def test_a_wheel_install_says_the_runpod_fake_comes_with_a_checkout(wheel, tmp_path):
    target, cwd, scratch = tmp_path / "site", tmp_path / "elsewhere", tmp_path / "tmp"
    cwd.mkdir()
    scratch.mkdir()
    argv = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "-q",
        "--target",
        str(target),
        str(wheel),
    ]
    installed = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed.stderr[-2000:]
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(target),
        "HOME": str(tmp_path),
        "TMPDIR": str(scratch),
    }
    show = [sys.executable, "-c", "import gpuhedge_celery as g; print(g.__file__)"]
    where = subprocess.run(show, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip().startswith(str(target)), where.stderr[-2000:]
    for args in (["--provider", "runpod-fake", "--rows", "capacity"], ["--rows", "truth"]):
        bench = [sys.executable, "-m", "gpuhedge_celery", "bench", "races", *args]
        run = subprocess.run(bench, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
        lines = run.stderr.strip().splitlines()
        assert run.returncode != 0 and run.stdout == "", (args, run.stderr[-2000:])
        assert len(lines) == 1 and "Traceback" not in run.stderr, (args, run.stderr[-2000:])
        assert "RunPod fake" in lines[0] and "source checkout" in lines[0]
        assert list(scratch.iterdir()) == []  # it stopped before a bench cluster's first step
