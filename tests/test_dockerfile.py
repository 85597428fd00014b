"""The image: hadolint-clean, installs exactly the lock CI tested (torch's CUDA 12 build of the same
version), CUDA forward compatibility and the video capability; the entry point, run for real."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = ROOT / "dali_pipe" / "cli" / "entrypoint.sh"


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name.lower())] = version
    return pins


def test_hadolint_clean():
    r = subprocess.run([_tool("hadolint"), "--failure-threshold", "info", str(ROOT / "Dockerfile")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_image_installs_the_lock_on_a_cuda12_base_with_compat_and_video():
    text = (ROOT / "Dockerfile").read_text()
    torch = _lock()["torch"]
    assert re.search(r"^FROM nvidia/cuda:12\.\d+\.\d+-base-ubuntu", text, re.M), "a CUDA 12 base with compat libs"
    assert "--constraint requirements.lock" in text and "COPY pyproject.toml requirements.lock" in text
    cu = re.search(r"download\.pytorch\.org/whl/cu(12\d)", text).group(1)
    assert f'"torch=={torch}+cu{cu}"' in text, "torch is the locked version, CUDA 12 build"
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility,video" in text
    assert 'ENTRYPOINT ["/opt/program/entrypoint"]' in text and "USER" not in text
    assert "uv venv --python 3.11" in text and sys.version_info[:2] == (3, 11), "the CPython the tests run"


def test_ci_and_readme_install_the_lock_and_this_environment_is_it():
    """The README's commands (which CI runs) install with the lock, and every package installed here that
    the lock names has the lock's version: the tests ran the locked stack."""
    readme = (ROOT / "README.md").read_text()
    commands = [ln for ln in readme.splitlines() if ln.startswith("python3 -m venv .venv")][:2]
    assert len(commands) == 2 and all("-c requirements.lock" in c for c in commands), commands
    assert "README.md" in (ROOT / ".ci" / "run").read_text()
    pins = _lock()
    installed = {re.sub(r"[-_.]+", "-", d.metadata["Name"].lower()): d.version for d in metadata.distributions()}
    wrong = {n: (installed[n], v) for n, v in pins.items() if n in installed and installed[n].split("+")[0] != v}
    assert not wrong, f"installed versions differ from requirements.lock: {wrong}"
    missing = [n for n in ("torch", "nvidia-dali-cuda120", "pytorch-lightning", "transformers") if n not in installed]
    assert not missing


@pytest.mark.network
def test_the_lock_resolves_for_linux_x86_64_and_cpython_311(tmp_path):
    """Every pin exists as a wheel for the image's platform and Python (uv reads the wheels' metadata
    by range requests; pip's dry run would download each wheel whole)."""
    lock = tmp_path / "requirements.txt"
    lock.write_text((ROOT / "requirements.lock").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    r = subprocess.run([_tool("uv"), "pip", "install", "--dry-run", "--no-deps", "--only-binary", ":all:",
                        "--python-platform", "x86_64-manylinux_2_28", "--python-version", "3.11",
                        "--target", str(tmp_path / "t"), "-r", str(lock)],
                       capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0 and re.search(r"dns error|Connection refused|Network is unreachable", r.stderr):
        pytest.skip(f"no route to PyPI: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Would install {len(_lock())} packages" in r.stderr, r.stderr[-1000:]


def _entry(tmp_path, args, *, driver: str | None, compat: str | None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    fake_py = tmp_path / "python"
    fake_py.write_text('#!/bin/sh\necho "PY LD=${LD_LIBRARY_PATH:-} ARGS=$*"\n')
    fake_py.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "CUDA_VERSION": "12.8.1", "DALI_PIPE_PYTHON": str(fake_py),
           "DALI_PIPE_PROGRAM": "/opt/program/train.py", "DALI_PIPE_COMPAT_DIR": str(tmp_path / "compat"),
           "DALI_PIPE_DRIVER_FILE": str(tmp_path / "version")}
    (tmp_path / "compat").mkdir(exist_ok=True)
    if compat:
        (tmp_path / "compat" / f"libcuda.so.{compat}").write_bytes(b"")
    if driver:
        (tmp_path / "version").write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver}  Sun Jan 1 "
                                          "00:00:00 UTC 2025\nGCC version:  gcc version 11.4.0\n")
    return subprocess.run(["sh", str(ENTRYPOINT), *args], capture_output=True, text=True, env=env, timeout=30)


def test_entrypoint_turns_on_forward_compatibility_only_for_an_older_driver(tmp_path):
    old = _entry(tmp_path / "a", ["train"], driver="470.57.02", compat="570.124.06")
    assert "driver 470.57.02 is older than CUDA 12.8.1 needs (570.124.06)" in old.stdout
    assert f"PY LD={tmp_path / 'a' / 'compat'} ARGS=/opt/program/train.py train" in old.stdout
    new = _entry(tmp_path / "b", ["--epochs", "2"], driver="575.51.03", compat="570.124.06")
    assert "entrypoint: driver 575.51.03, CUDA 12.8.1" in new.stdout
    assert "PY LD= ARGS=/opt/program/train.py --epochs 2" in new.stdout


def test_entrypoint_refuses_device_gpu_without_a_gpu(tmp_path):
    for args in (["--device", "gpu"], ["--device=gpu", "--epochs", "1"]):
        r = _entry(tmp_path, args, driver=None, compat=None)
        assert r.returncode == 2 and "PY" not in r.stdout
        assert r.stderr.strip().count("\n") == 0 and "--device gpu was asked but no GPU is visible" in r.stderr
    assert "PY LD= ARGS=/opt/program/train.py --device cpu" in _entry(tmp_path, ["--device", "cpu"], driver=None,
                                                                      compat=None).stdout


def test_entrypoint_is_shellcheck_clean():
    r = subprocess.run([_tool("shellcheck"), str(ENTRYPOINT), str(ROOT / "tools" / "lock.sh"),
                        str(ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
