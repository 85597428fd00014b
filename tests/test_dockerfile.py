"""The image: hadolint-clean, installs exactly the lock CI tested (a CUDA 12 build of the same torch that
PyTorch publishes), CUDA forward compatibility and the video capability; the entry point, run for real."""
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


# The CUDA builds PyTorch publishes for each torch release, on its own index (download.pytorch.org/whl/cuXYZ),
# from pytorch/pytorch RELEASE.md, "Release Compatibility Matrix" (stable and experimental CUDA columns), and
# the CUDA support-matrix RFCs: #178665 for 2.12 ("Deprecate CUDA 12.8 - Remove from CI/CD"; 12.6 legacy,
# 13.0 stable, 13.2 experimental), which 2.13 keeps (RELEASE.md row 2.13: CUDA 12.6, CUDA 13.0; experimental
# CUDA 13.2), and #190355 for 2.14. A torch bump adds its row here, from the same sources.
PUBLISHED_CUDA_BUILDS = {
    "2.11": ("cu126", "cu128", "cu130"),
    "2.12": ("cu126", "cu130", "cu132"),
    "2.13": ("cu126", "cu130", "cu132"),
    "2.14": ("cu126", "cu130", "cu132"),
}
# RELEASE.md's "PyTorch CUDA Support Matrix" for 2.12-2.14: the CUDA 12.6 build has Turing (7.5), the T4.
SM75_BUILDS = ("cu126", "cu130", "cu132")


def _dockerfile() -> str:
    """The Dockerfile's instructions (comments left out)."""
    return "\n".join(ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if not ln.lstrip().startswith("#"))


def _image_torch() -> tuple[str, str]:
    """(version, CUDA build) of the torch the Dockerfile installs; its --torch-backend must name the same build."""
    text = _dockerfile()
    m = re.search(r'"torch==([0-9.]+)\+(cu\d+)"', text)
    assert m, "the Dockerfile names torch as torch==VERSION+cuXYZ"
    backend = re.search(r"--torch-backend (\S+)", text)
    assert backend and backend.group(1) == m.group(2), "uv's --torch-backend is the build the pin names"
    assert "unsafe-best-match" not in text and "extra-index-url" not in text, "only torch comes from PyTorch's index"
    return m.group(1), m.group(2)


def test_image_torch_is_a_build_pytorch_publishes():
    """The Dockerfile's torch is the locked version, in a CUDA 12 build (DALI's cuda120 wheels and the
    R470/R535/R550 hosts) that PyTorch publishes for that version and that has sm_75 kernels (T4)."""
    version, build = _image_torch()
    assert version == _lock()["torch"], "the image's torch is the locked version"
    minor = ".".join(version.split(".")[:2])
    assert minor in PUBLISHED_CUDA_BUILDS, (f"torch {version}: add the CUDA builds PyTorch publishes for {minor} to "
                                            "PUBLISHED_CUDA_BUILDS (from RELEASE.md's compatibility matrix)")
    assert build in PUBLISHED_CUDA_BUILDS[minor], f"PyTorch publishes no {build} build of torch {minor}"
    assert build.startswith("cu12") and build in SM75_BUILDS


def test_image_installs_the_lock_on_a_cuda12_base_with_compat_and_video():
    text = _dockerfile()
    base = re.search(r"^FROM nvidia/cuda:(12)\.(\d+)\.\d+-base-ubuntu", text, re.M)
    assert base, "a CUDA 12 base with compat libs"
    _, build = _image_torch()
    assert int(base.group(2)) >= int(build[4:]), "the base's compat libraries are at least the CUDA torch needs"
    assert "--constraint requirements.lock" in text and "COPY pyproject.toml requirements.lock" in text
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility,video" in text
    assert 'ENTRYPOINT ["/opt/program/entrypoint"]' in text and "USER" not in text and "CMD" not in text
    assert "uv venv --python 3.11" in text and sys.version_info[:2] == (3, 11), "the CPython the tests run"


def test_texts_name_the_torch_build_the_image_installs():
    """README, Dockerfile comments, pyproject and tools/lock.sh say the CUDA version of the image's torch."""
    _, build = _image_torch()
    cuda = f"{build[2:4]}.{build[4:]}"
    for name in ("README.md", "Dockerfile", "pyproject.toml", "tools/lock.sh"):
        text = " ".join((ROOT / name).read_text().split())
        said = set(re.findall(r"CUDA (1[23]\.\d+) build", text))
        assert said <= {cuda}, f"{name} names a CUDA {said - {cuda}} build of torch; the image installs {build}"
    assert f"CUDA {cuda} build" in " ".join((ROOT / "README.md").read_text().split())


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


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements) -> list[str]:
    return [re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", r).group(0).lower()) for r in requirements]


def test_dali_is_an_extra_per_cuda_variant_and_every_install_names_the_locks():
    """No DALI among the runtime requirements (an environment's own DALI, of any CUDA variant, stays the only
    one); one extra per variant, each naming its wheel alone, and the lock pins both wheels; the README's two
    commands, the Dockerfile and tools/lock.sh install cuda120 (the image's CUDA 12)."""
    project = _pyproject()
    assert not [n for n in _names(project["dependencies"]) if n.startswith("nvidia-dali")]
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items()}
    variants = {k: v for k, v in extras.items() if any(n.startswith("nvidia-dali") for n in v)}
    assert variants == {"cuda120": ["nvidia-dali-cuda120"], "cuda130": ["nvidia-dali-cuda130"]}, variants
    assert [n for n in _lock() if n.startswith("nvidia-dali")] == ["nvidia-dali-cuda120", "nvidia-dali-cuda130"]
    readme = (ROOT / "README.md").read_text()
    commands = [ln for ln in readme.splitlines() if ln.startswith("python3 -m venv .venv")][:2]
    assert "-e '.[cuda120]'" in commands[0] and "-e '.[cuda120,test]'" in commands[1], commands
    assert "--requirement pyproject.toml --extra cuda120" in _dockerfile()
    assert "--extra cuda120 --extra test" in (ROOT / "tools" / "lock.sh").read_text()


@pytest.mark.network
def test_installing_beside_another_dali_variant_adds_no_second_copy(tmp_path):
    """Resolved by uv for the GPU machine's CPython 3.12 into a site folder that holds DALI's CUDA 13 wheel
    already (as an NGC container or an unpacked wheel does): the package alone and with [cuda130] install no
    DALI (nothing else in nvidia/dali/), while [cuda120] would be the second copy, which the docs warn of."""
    site = tmp_path / "site"
    info = site / "nvidia_dali_cuda130-2.4.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-dali-cuda130\nVersion: 2.4.0\n")
    (info / "RECORD").write_text("")
    (info / "INSTALLER").write_text("pip\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}

    def would_install(*extra):
        r = subprocess.run([_tool("uv"), "pip", "install", "--dry-run", "--no-deps", "--only-binary", ":all:",
                            "--python-platform", "x86_64-manylinux_2_28", "--python-version", "3.12",
                            "--target", str(site), "-r", str(ROOT / "pyproject.toml"), *extra],
                           capture_output=True, text=True, timeout=300, env=env)
        if r.returncode != 0 and re.search(r"dns error|Connection refused|Network is unreachable", r.stderr):
            pytest.skip(f"no route to PyPI: {r.stderr.strip().splitlines()[-1]}")
        assert r.returncode == 0, r.stderr[-3000:]
        return re.findall(r"^ \+ ([a-z0-9-]+)==", r.stderr, re.M)

    plain, cuda130, cuda120 = would_install(), would_install("--extra", "cuda130"), would_install("--extra", "cuda120")
    assert "torch" in plain and not [n for n in plain + cuda130 if n.startswith("nvidia-dali")], (plain, cuda130)
    assert "nvidia-dali-cuda120" in cuda120


@pytest.mark.network
@pytest.mark.parametrize("extra", ["cuda120", "cuda130"])
def test_each_dali_extra_resolves_within_the_lock_to_an_nvjpeg_the_decoder_rule_knows(tmp_path, extra):
    """uv resolves the extra (its DALI wheel and all that wheel pulls in) with the lock as constraints, for the
    image's platform and Python: every package it would install is one the lock pins, at the lock's version.
    Its nvJPEG is of the extra's CUDA major; with either, nvImageCodec 0.9 refuses the ROI decode with fancy
    upsampling (measured under 13.3.2, the cuda130 pin), so the GPU training decode is the whole decode and a
    GPU crop (dali_pipe/decoder.py)."""
    from dali_pipe.decoder import Nvjpeg

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    wanted = _pyproject()["optional-dependencies"][extra]
    r = subprocess.run([_tool("uv"), "pip", "install", "--dry-run", "--only-binary", ":all:",
                        "--python-platform", "x86_64-manylinux_2_28", "--python-version", "3.11",
                        "--target", str(tmp_path / "t"), "-c", str(ROOT / "requirements.lock"), *wanted],
                       capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0 and re.search(r"dns error|Connection refused|Network is unreachable", r.stderr):
        pytest.skip(f"no route to PyPI: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    resolved = dict(re.findall(r"^ \+ ([a-z0-9-]+)==(\S+)", r.stderr, re.M))
    lock = _lock()
    assert f"nvidia-dali-{extra}" in resolved, resolved
    off = {n: v for n, v in resolved.items() if lock.get(n) != v}
    assert not off, f"resolved outside the lock (rerun tools/lock.sh): {off}"
    nvjpeg = [v for n, v in resolved.items() if n.startswith("nvidia-nvjpeg") and not n.startswith("nvidia-nvjpeg2k")]
    assert len(nvjpeg) == 1, resolved
    version = tuple(int(x) for x in nvjpeg[0].split(".")[:3])
    assert version[0] == {"cuda120": 12, "cuda130": 13}[extra], version
    assert not Nvjpeg(version, "lock").roi_with_fancy_upsampling  # nvImageCodec 0.9 refuses it on either


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


def _entry(tmp_path, args, *, driver: str | None, compat: str | None, cuinit: int = 0, compat_cuinit: int = 0):
    """Run the entry point with a fake driver version file, compat folder and Python; the fake Python's
    `-c` (the entry point's cuInit probe) exits with `compat_cuinit` when the compat folder leads
    LD_LIBRARY_PATH, else `cuinit`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    fake_py = tmp_path / "python"
    fake_py.write_text('#!/bin/sh\nif [ "$1" = -c ]; then case "${LD_LIBRARY_PATH:-}" in *compat*) exit "$COMPAT_CUINIT";; '
                       '*) exit "$CUINIT";; esac; fi\necho "PY LD=${LD_LIBRARY_PATH:-} ARGS=$*"\n')
    fake_py.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "CUDA_VERSION": "12.6.3", "DALI_PIPE_PYTHON": str(fake_py),
           "DALI_PIPE_PROGRAM": "/opt/program/train.py", "DALI_PIPE_COMPAT_DIR": str(tmp_path / "compat"),
           "DALI_PIPE_DRIVER_FILE": str(tmp_path / "version"), "CUINIT": str(cuinit),
           "COMPAT_CUINIT": str(compat_cuinit), "SAGEMAKER_BASE_DIR": str(tmp_path / "no-job")}
    (tmp_path / "compat").mkdir(exist_ok=True)
    if compat:
        (tmp_path / "compat" / f"libcuda.so.{compat}").write_bytes(b"")
    if driver:
        (tmp_path / "version").write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver}  Sun Jan 1 "
                                          "00:00:00 UTC 2025\nGCC version:  gcc version 11.4.0\n")
    return subprocess.run(["sh", str(ENTRYPOINT), *args], capture_output=True, text=True, env=env, timeout=30)


COMPAT = "560.35.05"  # CUDA 12.6's forward-compatibility libcuda (the base image's)


def test_entrypoint_turns_on_forward_compatibility_only_for_an_older_driver(tmp_path):
    """R470 (or R535, R550) on a data-center GPU: the compat libraries work, so they lead LD_LIBRARY_PATH;
    a newer driver runs as it is."""
    old = _entry(tmp_path / "a", ["train"], driver="470.57.02", compat=COMPAT)
    assert f"driver 470.57.02 is older than CUDA 12.6.3 needs ({COMPAT})" in old.stdout
    assert f"PY LD={tmp_path / 'a' / 'compat'} ARGS=/opt/program/train.py train" in old.stdout
    new = _entry(tmp_path / "b", ["--epochs", "2"], driver="575.51.03", compat=COMPAT)
    assert "entrypoint: driver 575.51.03, CUDA 12.6.3" in new.stdout
    assert "PY LD= ARGS=/opt/program/train.py --epochs 2" in new.stdout


def test_entrypoint_without_forward_compatibility_uses_a_cuda12_driver_as_it_is(tmp_path):
    """R550 on a GPU that cannot use forward compatibility (cuInit 804 through the compat libraries): the
    driver's own CUDA 12 runs it, compat libraries off; R470 there cannot run CUDA 12: one line, exit 2,
    unless --device cpu."""
    r550 = _entry(tmp_path / "a", ["--epochs", "1"], driver="550.127.05", compat=COMPAT, compat_cuinit=804 % 256)
    assert "cannot use the forward-compatibility libraries (cuInit error 36" in r550.stdout
    assert "minor version compatibility" in r550.stdout and "PY LD= ARGS=/opt/program/train.py --epochs 1" in r550.stdout
    r470 = _entry(tmp_path / "b", ["train"], driver="470.256.02", compat=COMPAT, compat_cuinit=36)
    assert r470.returncode == 2 and "PY" not in r470.stdout and r470.stderr.count("\n") == 1
    assert "driver 470.256.02 has no CUDA 12" in r470.stderr and "install driver 525.60.13 or later" in r470.stderr
    cpu = _entry(tmp_path / "c", ["--device", "cpu"], driver="470.256.02", compat=COMPAT, compat_cuinit=36)
    assert cpu.returncode == 0 and "PY LD= ARGS=/opt/program/train.py --device cpu" in cpu.stdout
    nogpu = _entry(tmp_path / "d", ["--device=gpu"], driver="470.256.02", compat=COMPAT, compat_cuinit=100)
    assert nogpu.returncode == 2 and "no GPU in this container" in nogpu.stdout and "--device gpu was asked" in nogpu.stderr


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


def test_gpu_check_uses_only_flags_train_py_has():
    """Every flag tools/gpu_check.sh passes to train.py (the recipe's too) is one of its flags, so the check
    cannot fail on a typo where no GPU test would see it."""
    from dali_pipe.cli import train_parser

    known = {s for a in train_parser()._actions for s in a.option_strings}
    text = (ROOT / "tools" / "gpu_check.sh").read_text().replace("\\\n", " ")
    calls = [ln.split('"${BENCH[@]}"')[-1] for ln in text.splitlines()
             if "train.py --benchmark" in ln or '"${BENCH[@]}"' in ln]  # the flags after train.py's common ones
    used = {f for ln in calls for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", ln)}
    assert len(calls) >= 3 and {"--cpus", "--packed", "--auto-augment", "--mixup-alpha", "--clip-grad-norm"} <= used
    assert used <= known, used - known


def test_gpu_check_without_a_gpu_says_so_and_ends_in_its_summary(tmp_path):
    """No GPU visible: the versions step reports it (with the stack it found), every GPU step is reported as not
    run, the summary is written, at most the 8 files the check promises are left in OUT, and the exit status is 1."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path)}
    r = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), str(out)], capture_output=True, text=True,
                       timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    summary = (out / "summary.md").read_text()
    assert "| versions | FAILED: no CUDA GPU visible |" in summary and "dali:" in summary
    for name in ("data", "gpu tests", "probe", "recipe benchmark", "benchmark"):
        assert f"| {name} | not run: no CUDA GPU visible | 0 |" in summary, summary
    promised = {"log.txt", "versions.txt", "gpu-tests.txt", "probe.json", "benchmark-recipe.json", "benchmark.json",
                "benchmark.png", "summary.md"}
    assert {p.name for p in out.iterdir()} <= promised and "Traceback" not in r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("GPU check: FAILED (see summary.md)")
    assert not list(tmp_path.glob("gpu-check.*")), "the work folder is removed"


def test_gpu_check_says_its_usage_and_its_step_limits_fit_its_budget(tmp_path):
    """`--help` prints the header's usage and exits 0 (before: mkdir's usage, exit 2); an unknown option is a
    usage error; the steps' own limits add up to no more than the default budget, so the last step (the
    benchmark, the headline) is not the one cut; GPU_CHECK_SKIP skips steps by name."""
    script = ROOT / "tools" / "gpu_check.sh"
    r = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert r.returncode == 0 and "usage: tools/gpu_check.sh [OUT] [STEPS]" in r.stdout and not r.stderr, r
    assert not list(tmp_path.iterdir()), "--help wrote nothing"
    r = subprocess.run(["bash", str(script), "--bogus"], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert r.returncode == 2 and "unknown option --bogus" in r.stderr
    text = script.read_text()
    budget = int(re.search(r"BUDGET=\$\{GPU_CHECK_BUDGET:-(\d+)\}", text).group(1))
    limits = [int(x) for x in re.findall(r'^\s*step (?:[a-z]+|"[a-z ]+") (\d+) ', text, re.M)]
    assert len(limits) == 6 and sum(limits) <= budget, (limits, budget)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path),
           "GPU_CHECK_SKIP": "data,probe"}
    r = subprocess.run(["bash", str(script), str(out)], capture_output=True, text=True, timeout=300, env=env)
    summary = (out / "summary.md").read_text()
    assert "| data | not run: skipped (GPU_CHECK_SKIP) | 0 |" in summary and "| probe | not run: skipped" in summary
    assert "| gpu tests | not run: no CUDA GPU visible | 0 |" in summary


def test_the_image_compiles_bytecode_at_install_since_it_never_writes_it_at_run_time():
    """PYTHONDONTWRITEBYTECODE keeps a container from writing __pycache__, and uv installs without bytecode by
    default: without UV_COMPILE_BYTECODE every start of the image compiled torch, Lightning and transformers
    again: importing torch, Lightning, transformers and DALI took 15.6 s (14.2-15.8) without bytecode against
    7.2 s (6.8-7.2) with it on 2 cores, 3 runs each (`python -X pycache_prefix=EMPTY`), in every process a
    start or a restart launches."""
    env = dict(re.findall(r"^\s*(?:ENV\s+)?([A-Z_]+)=(\S+?)\s*\\?$", _dockerfile(), re.M))
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1" and env.get("UV_COMPILE_BYTECODE") == "1"
    assert "--no-compile" not in _dockerfile()
