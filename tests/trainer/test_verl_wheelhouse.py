"""scripts/offline_wheelhouse.sh: argument errors, and a real small wheelhouse split, reassembled and installed offline.

The real run fetches one small pure-Python project (python-dateutil) from the package index; never vllm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "offline_wheelhouse.sh"


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.mark.parametrize("args, message", [
    (["--python", "312"], "--python must look like 3.12"),
    (["--have", "/nonexistent/freeze.txt"], "pip freeze > have.txt"),
    (["--split", "lots"], "--split must be a size"),
    (["--glibc", "2.5"], "--glibc must look like 2.39"),
    (["--frobnicate"], "unknown option --frobnicate"),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    result = _run(*args)
    assert result.returncode == 2
    assert message in result.stderr and result.stderr.count("\n") == 1


def test_help_lists_the_options():
    result = _run("--help")
    assert result.returncode == 0
    for option in ("--have", "--split", "--slim-ray", "--python", "--glibc", "--platform"):
        assert option in result.stdout


@pytest.mark.slow
def test_wheelhouse_skips_host_packages_splits_and_installs_offline(tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    (build / "have.txt").write_text("tzdata==2025.2\n-e git+https://example.invalid/x.git#egg=x\n")
    result = _run("--out", "wh", "--have", "have.txt", "--split", "20K", "python-dateutil", cwd=build)
    assert result.returncode == 0, result.stderr
    wheels = sorted(p.name for p in (build / "wh").glob("*.whl"))
    assert len(wheels) == 1 and wheels[0].startswith("python_dateutil-"), "tzdata is on the host: not fetched"
    parts = sorted(build.glob("wh.tar.part-*"))
    assert len(parts) > 1 and all(p.stat().st_size <= 20 * 1024 for p in parts)

    host = tmp_path / "host"  # gets only the parts, then runs the printed command with --target
    host.mkdir()
    for part in parts:
        shutil.copy(part, host)
    command = next(line for line in result.stdout.splitlines() if line.startswith("cat wh.tar.part-*"))
    command = command.replace("pip install", f"{sys.executable} -m pip install --target site")
    install = subprocess.run(command, shell=True, cwd=host, check=False, capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stderr
    imported = subprocess.run([sys.executable, "-c", "import dateutil; print(dateutil.__file__)"], check=False,
                              env={**os.environ, "PYTHONPATH": str(host / "site")}, capture_output=True, text=True)
    assert imported.returncode == 0 and str(host / "site") in imported.stdout


@pytest.mark.slow
def test_host_versions_override_conflicting_pins(tmp_path):
    # python-dateutil needs six>=1.5: a host with six 1.4.0 keeps it (as a host with transformers 5.17 keeps it
    # under verl's transformers<5.11 pin) instead of failing the resolution, and six is not fetched
    (tmp_path / "have.txt").write_text("six==1.4.0\n")
    result = _run("--out", "wh", "--have", "have.txt", "--glibc", "2.39", "python-dateutil", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    fetched = {p.name.split("-")[0] for p in (tmp_path / "wh").glob("*.whl")}
    assert "python_dateutil" in fetched and "six" not in fetched, fetched


@pytest.mark.slow
def test_source_only_dependency_is_built_into_a_pure_wheel(tmp_path):
    # hydra-core 1.3 needs antlr4-python3-runtime 4.9.*, published only as source: without --build the resolution
    # fell back to hydra-core 0.11 (the only version without it), which our configs cannot run on
    (tmp_path / "have.txt").write_text("pyyaml==6.0.2\npackaging==25.0\n")
    result = _run("--out", "wh", "--have", "have.txt", "--glibc", "2.39", "hydra-core>=1.3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    wheels = sorted(p.name for p in (tmp_path / "wh").glob("*.whl"))
    assert any(w.startswith("hydra_core-1.3.") for w in wheels), wheels
    assert any(w.startswith("antlr4_python3_runtime-4.9.") and w.endswith("-py3-none-any.whl") for w in wheels), wheels
