"""SageMaker contract (fake /opt/ml in tmp_path), spot-safe checkpoints, SIGTERM and kill -9."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dali_pipe.cli.sagemaker import build_argv, hyperparameter_argv

ROOT = Path(__file__).resolve().parents[1]


def _opt_ml(tmp_path, photo_root, hp: dict, resources=None):
    base = tmp_path / "opt_ml"
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = base / "input" / "config"
    cfg.mkdir(parents=True)
    (cfg / "hyperparameters.json").write_text(json.dumps(hp))
    (cfg / "inputdataconfig.json").write_text(json.dumps({"training": {"TrainingInputMode": "File"}}))
    (cfg / "resourceconfig.json").write_text(json.dumps(resources or {"current_host": "algo-1", "hosts": ["algo-1"]}))
    (base / "input" / "data").mkdir(parents=True)
    os.symlink(photo_root, base / "input" / "data" / "training")
    return base


def _run(base, cache_dir, *args, timeout=600, env=None):
    env = {**os.environ, "SAGEMAKER_BASE_DIR": str(base), "DALI_PIPE_CACHE": str(cache_dir), **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), "train", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_bad_hyperparameter_writes_failure(tmp_path, photo_root, cache_dir):
    """A bad value is told in the job's words before torch or Lightning load (the meeting's module loaded
    Lightning first: ~10 s before a typo was said)."""
    base = _opt_ml(tmp_path, photo_root, {"epochs": "banana", "model": "tiny", "device": "cpu"})
    code = ("import sys\nsys.argv = ['train.py', 'train']\nimport train\nfrom dali_pipe.cli import cli\n"
            "try:\n    sys.exit(cli(train.main))\nfinally:\n"
            "    print('LOADED', [m for m in ('torch', 'pytorch_lightning') if m in sys.modules])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "SAGEMAKER_BASE_DIR": str(base), "DALI_PIPE_CACHE": str(cache_dir)})
    assert r.returncode != 0
    assert "LOADED []" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    failure = (base / "output" / "failure").read_text()
    assert "\"epochs\": 'banana' is not an integer" in failure and len(failure) <= 1024  # the key, not --epochs
    assert "--epochs" not in failure and "--epochs" not in r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in failure


def test_two_host_resourceconfig_sets_rank_and_master(tmp_path):
    base = tmp_path / "opt_ml"
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "resourceconfig.json").write_text(
        json.dumps({"current_host": "algo-2", "hosts": ["algo-1", "algo-2"]}))
    argv, env = build_argv(base, [], {})
    assert env["MASTER_ADDR"] == "algo-1" and env["NODE_RANK"] == "1" and env["MASTER_PORT"] == "29500"
    assert argv[argv.index("--num-nodes") + 1] == "2" and argv[argv.index("--devices") + 1] == "auto"
    assert argv[argv.index("--data") + 1] == str(base / "input" / "data" / "training")
    assert argv[argv.index("--output") + 1] == str(base / "model")


def test_sm_env_and_s3_data_hyperparameter(tmp_path):
    base = tmp_path / "opt_ml"
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps({"data": "s3://b/p"}))
    argv, env = build_argv(base, [], {"SM_MODEL_DIR": "/m", "SM_NUM_GPUS": "4", "SM_HOSTS": '["h1"]',
                                      "SM_CURRENT_HOST": "h1"})
    assert argv[argv.index("--data") + 1] == "s3://b/p" and "--num-nodes" not in argv
    assert argv[argv.index("--output") + 1] == "/m" and argv[argv.index("--devices") + 1] == "4"


def test_hyperparameters_as_sagemaker_sends_them(tmp_path, capsys):
    """Framework estimators JSON-encode values and add sagemaker_* keys; tuning jobs add
    _tuning_objective_metric. Values unwrap, SageMaker's keys are ignored with one note."""
    base = tmp_path / "opt_ml"
    (base / "input" / "config").mkdir(parents=True)
    hp = {"model": '"tiny"', "epochs": "3", "batch_size": 16, "monitor": "true", "lr": "0.001",
          "sagemaker_program": '"train.py"', "sagemaker_region": '"us-east-1"', "sagemaker_submit_directory": '"s3://x"',
          "_tuning_objective_metric": "validation:accuracy"}
    (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps(hp))
    (base / "input" / "config" / "inputdataconfig.json").write_text(
        json.dumps({"training": {"TrainingInputMode": "FastFile"}}))
    argv, _ = build_argv(base, [], {})
    assert argv[:10] == ["--model", "tiny", "--epochs", "3", "--batch-size", "16", "--monitor", "true", "--lr", "0.001"]
    note = capsys.readouterr().out
    assert "ignoring 4 key(s) set by SageMaker itself: _tuning_objective_metric, sagemaker_program" in note
    from dali_pipe.cli import parse_train

    assert parse_train([a for a in argv if not a.startswith("/")][:10]).model.model == "tiny"


def test_bad_hyperparameters_are_each_named(tmp_path):
    from dali_pipe.cli.sagemaker import SageMakerError

    base = tmp_path / "opt_ml"
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps(
        {"batchsize": "8", "model": None, "aws-secret-access-key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
         "output": "/x"}))
    with pytest.raises(SageMakerError) as e:
        build_argv(base, [], {})
    msg = str(e.value)
    assert "unknown hyperparameter 'batchsize' (did you mean 'batch-size'?)" in msg
    assert "hyperparameter 'model' is null" in msg and "'output' is set by the SageMaker contract" in msg
    assert "unknown hyperparameter 'aws-secret-access-key'" in msg and "wJalr" not in msg
    assert "environment, not hyperparameters" in msg


def test_secrets_never_reach_stdout_stderr_or_failure(tmp_path, photo_root, cache_dir):
    """A secret in a bad hyperparameter's value; then user:pass@ in AWS_ENDPOINT_URL when S3 fails."""
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    env = {"AWS_ENDPOINT_URL": "http://admin:s3cr3tpass@127.0.0.1:9", "AWS_ACCESS_KEY_ID": "AKIAABCDEFGHIJKLMNOP",
           "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1"}
    runs = [({"epochs": f"--token={secret}", "model": "tiny", "device": "cpu"}, 'argument "epochs"'),
            ({"model": "tiny", "device": "cpu", "data": "s3://bucket/prefix"}, "cannot reach http://[redacted]@127.0.0.1:9")]
    for i, (hp, expected) in enumerate(runs):
        base = _opt_ml(tmp_path / str(i), photo_root, hp)
        r = _run(base, cache_dir, timeout=180, env=env)
        failure = (base / "output" / "failure").read_text()
        for text in (r.stdout, r.stderr, failure):
            assert secret not in text and "s3cr3tpass" not in text and "AKIAABCDEFGHIJKLMNOP" not in text, text
        assert expected in failure and "Traceback" not in failure and r.returncode == 1, failure


def test_failure_text_is_redacted_and_bounded(tmp_path):
    from dali_pipe.cli.sagemaker import write_failure

    write_failure(tmp_path, "boom AKIAABCDEFGHIJKLMNOP secret_key=hunter2 " + "x" * 3000)
    text = (tmp_path / "failure").read_text()
    assert "AKIA" not in text and "hunter2" not in text and len(text) <= 1024


def test_an_output_folder_that_cannot_take_the_failure_is_one_line(tmp_path, capsys):
    """output/ that is a file (or read-only): one line saying so, not a traceback that hides the reason."""
    from dali_pipe.cli.sagemaker import write_failure

    (tmp_path / "output").write_text("not a folder")
    write_failure(tmp_path / "output", "invalid hyperparameters")
    assert f"could not write {tmp_path / 'output' / 'failure'}" in capsys.readouterr().err


def test_hyperparameter_spellings_are_not_overridden(tmp_path):
    """'cache_dir' and 'cache-dir' both count as the user's choice; the contract adds no second value."""
    base = tmp_path / "opt_ml"
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps({"cache_dir": "/nvme", "devices": "2"}))
    argv, _ = build_argv(base, [], {})
    assert argv.count("--cache-dir") == 1 and argv[argv.index("--cache-dir") + 1] == "/nvme"
    assert argv.count("--devices") == 1


# -- the jobs the SageMaker SDK's own local mode lays out (tests/sagemaker_sdk/, see its README) ----------
SDK = ROOT / "tests" / "sagemaker_sdk"
MODEL_FILES = {"config.json", "model.safetensors", "preprocessor_config.json", "label_map.json", "metrics.json"}
OURS = re.compile(r"lock|\.tmp|-tmp-|write-test|\.part-|sync-running")  # names of our locks and temporary files


def sdk_job(case: str, tmp_path: Path, data: Path, data_for: dict | None = None):
    """The job as the SDK's docker-compose.yaml mounts it: each host's /opt/ml is a folder of links into the
    SDK's root (one model/ shared by all hosts, input/ and output/ per host, the training channel: `data`, or
    data_for[i] for the i-th host), with the config files the SDK wrote.
    Returns (root, {host: (opt_ml, environment, argv)})."""
    import shutil

    import yaml

    compose = yaml.safe_load((SDK / case / "docker-compose.yaml").read_text())
    root, jobs = tmp_path / "sdk-root", {}
    for i, (host, service) in enumerate(sorted(compose["services"].items())):
        base = tmp_path / host / "opt_ml"
        mounts = [v[:-2] if v.endswith(":z") else v for v in service["volumes"]]
        for src, dst in sorted((v.rsplit(":", 1) for v in mounts), key=lambda m: m[1].count("/")):
            if "${CODE}" in src:
                continue
            src = Path(src.replace("${ROOT}", str(root)).replace("${DATA}", str((data_for or {}).get(i, data))))
            target = base / Path(dst).relative_to("/opt/ml")
            src.mkdir(parents=True, exist_ok=True)
            if target.exists() and target.resolve() == src.resolve():
                continue  # inside a mount made above (output/data within output)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(src)
        shutil.copytree(SDK / case / host / "input" / "config", base / "input" / "config")
        env = dict(e.split("=", 1) for e in service["environment"] if "${AWS_" not in e)
        jobs[host] = (base, env, [service["command"]] if "command" in service else [])
    return root, jobs


def _nothing_of_ours(root: Path) -> None:
    """model/ holds the model and nothing else; no lock or temporary file anywhere in the job."""
    assert {p.name for p in (root / "model").iterdir()} == MODEL_FILES
    strays = [str(p) for p in root.rglob("*") if OURS.search(p.name)]
    assert not strays, strays


@pytest.mark.parametrize("case", ["v2-estimator-1host", "v3-modeltrainer-1host"])
def test_sdk_local_mode_jobs_train_into_model(case, tmp_path, photo_root, cache_dir, monkeypatch, capsys):
    """A job laid out as SDK 2.x's Estimator (`train`, str() values such as '(0.35, 1.0)' and 'False') and
    SDK 3.x's ModelTrainer (no command at all, JSON values) lay it out: exit 0, the model in model/ and
    nothing else of ours there, the scan report in output/data, logs in output/tensorboard."""
    import train

    root, jobs = sdk_job(case, tmp_path, photo_root)
    (host, (base, env, argv)), = jobs.items()
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(base))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    result = train.main(argv)
    assert result["global_step"] == 36 // 8  # 48 photos, val-fraction 0.25, batch 8, one epoch
    _nothing_of_ours(root)
    assert (base / "output" / "data" / "bad_images.tsv").is_file() and not (base / "output" / "failure").exists()
    assert list((base / "output" / "tensorboard").glob("events.*")) and (base / "checkpoints" / "last.ckpt").is_file()
    out = capsys.readouterr().out
    assert ("started with no command inside a training job" in out) == (argv == [])
    for name in ("train_loss", "train_acc", "val_loss", "val_acc"):  # the README's metric_definitions
        assert re.search(rf"METRIC epoch=1 .*{name}=([0-9.]+)", out), name
    assert '; "batch-size": 7 would drop 3.' in out, out  # the advice names the hyperparameter, not --batch-size
    if case != "v2-estimator-1host":
        return
    # a new job with another lr whose checkpoint_s3_uri is reused (its checkpoints restored, model/ empty): it
    # fails saying why (before: "exporting the model again", the previous job's model as its artifact, exit 0)
    hp = json.loads((base / "input" / "config" / "hyperparameters.json").read_text())
    (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps({**hp, "lr": "0.05"}))
    for f in (root / "model").iterdir():
        f.unlink()
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    failure = (base / "output" / "failure").read_text()
    assert e.value.code == 1 and "belongs to another run:\n  \"lr\": 0.002 in the checkpoint, 0.05 now" in failure
    assert "another checkpoint_s3_uri" in failure and '"resume": "never"' in failure and "Traceback" not in failure
    assert not list((root / "model").iterdir()) and "METRIC" not in capsys.readouterr().out


def test_sdk_framework_estimator_json_values_reach_the_same_settings(tmp_path, photo_root):
    """SDK 2.x's PyTorch estimator JSON-encodes every value and adds sagemaker_* keys: same settings as
    the generic Estimator's str() values."""
    from dali_pipe.cli import parse_train

    settings = []
    for case in ("v2-pytorch-1host", "v2-estimator-1host"):
        _, jobs = sdk_job(case, tmp_path / case, photo_root)
        (base, _, _), = jobs.values()
        argv, _ = build_argv(base, [], {})
        s = parse_train(argv)
        settings.append((s.model.model, s.pipeline.crop_scale, s.run.monitor, s.model.lr, s.data.val_fraction,
                         s.pipeline.device, s.model.epochs))
    assert settings[0] == settings[1] == ("tiny", [0.35, 1.0], False, 0.002, 0.25, "cpu", 1)


def _hosts_namespace(tmp_path: Path, names) -> list[str]:
    """A command prefix that runs a process with `names` resolving to 127.0.0.1, as docker's network aliases
    make them resolve to each container: /etc/hosts bind-mounted in a private mount namespace (skips the
    test where unshare or mount is refused)."""
    hosts = tmp_path / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text() + "".join(f"127.0.0.1 {n}\n" for n in names))
    prefix = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)]
    try:
        probe = subprocess.run(prefix + ["getent", "hosts", names[-1]], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("unshare is not installed")
    if probe.returncode != 0 or "127.0.0.1" not in probe.stdout:
        pytest.skip(f"cannot give the test hosts their own /etc/hosts here: {probe.stderr.strip()[:200]}")
    return prefix


def _start_hosts(tmp_path: Path, jobs: dict, only=None) -> dict:
    """Each host's contract in its own process, as SageMaker starts one container per host."""
    from test_hosts import free_port

    prefix = _hosts_namespace(tmp_path, list(jobs))
    port = str(free_port())
    procs = {}
    for host, (base, env, argv) in jobs.items():
        if only and host not in only:
            continue
        penv = {**os.environ, **env, "SAGEMAKER_BASE_DIR": str(base), "MASTER_PORT": port, "PYTHONUNBUFFERED": "1",
                "DALI_PIPE_CACHE": str(base.parent / "cache")}
        procs[host] = subprocess.Popen(prefix + [sys.executable, str(ROOT / "train.py"), *argv], env=penv,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return procs


def _finish(procs: dict, timeout: float = 300) -> dict:
    out = {}
    for host, p in procs.items():
        try:
            text, _ = p.communicate(timeout=timeout)
        finally:
            p.kill()
        out[host] = (p.returncode, text)
    return out


@pytest.mark.slow
def test_sdk_two_host_job_shares_one_model_folder(tmp_path, photo_root):
    """SDK 2.x's 2-instance local-mode job: two host processes, host names resolving to loopback, one model/
    mounted in both. Only the first host locks and writes it: both exit 0, the model in model/ and nothing
    else of ours anywhere."""
    root, jobs = sdk_job("v2-estimator-2host", tmp_path, photo_root)
    results = _finish(_start_hosts(tmp_path, jobs))
    for host, (code, text) in results.items():
        assert code == 0, f"{host}:\n{text[-3000:]}"
        assert "hosts: all 2 arrived" in text
    _nothing_of_ours(root)
    assert "TRAINED global_step=2" in results[sorted(results)[0]][1]  # 36 images / 2 hosts / batch 8


@pytest.mark.slow
def test_a_failed_host_stops_the_others_naming_it(tmp_path, photo_root):
    """The second host's channel has no dataset.tsv: it fails at once, and the first host, instead of waiting
    for it, exits 1 within seconds with the second host's reason in its output/failure; model/ stays empty."""
    empty = tmp_path / "empty-channel"
    empty.mkdir()
    root, jobs = sdk_job("v2-estimator-2host", tmp_path, photo_root, data_for={1: empty})
    first, second = sorted(jobs)
    results = _finish(_start_hosts(tmp_path, jobs), timeout=120)
    assert results[second][0] == 1 and "holds none of the input forms" in (jobs[second][0] / "output" / "failure").read_text()
    failure = (jobs[first][0] / "output" / "failure").read_text()
    assert results[first][0] == 1, results[first][1][-2000:]
    assert f'host {second} failed: invalid arguments: "data":' in failure and "holds none of the input forms" in failure
    assert not list((root / "model").iterdir()) and not [p for p in root.rglob("*") if OURS.search(p.name)]


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_while_waiting_for_the_first_host_ends_at_once(tmp_path, photo_root, sig):
    """The second host waits for a first host that never comes; SIGTERM (docker stop, a stopped job) ends it
    within seconds with exit 143, one clear line and the same reason in output/failure; Ctrl-C (docker run -it)
    with exit 130 and "stopped by Ctrl-C" (before: a bare "error: ", exit 1)."""
    import signal
    import time

    root, jobs = sdk_job("v2-estimator-2host", tmp_path, photo_root)
    first, second = sorted(jobs)
    proc = _start_hosts(tmp_path, jobs, only=[second])[second]
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "waiting for host" in line:
            break
    start = time.monotonic()
    proc.send_signal(getattr(signal, sig))
    text = "".join(lines) + proc.communicate(timeout=30)[0]
    code, reason = ((143, f"stopped by SIGTERM while waiting for host {first} (the first host)") if sig == "SIGTERM"
                    else (130, "stopped by Ctrl-C"))
    assert proc.returncode == code and time.monotonic() - start < 10, text[-2000:]
    assert reason in text and (jobs[second][0] / "output" / "failure").read_text() == reason
    assert "error: \n" not in text and "Traceback" not in text, text[-2000:]


# -- every value form the SDKs send, each to the same setting ---------------------------------------------
@pytest.mark.parametrize("raw, field, want", [
    pytest.param("[0.35, 1.0]", "crop_scale", [0.35, 1.0], id="json-list"),
    pytest.param("(0.35, 1.0)", "crop_scale", [0.35, 1.0], id="str-of-tuple"),
    pytest.param("[0.35, 1]", "crop_scale", [0.35, 1.0], id="str-of-list"),
    pytest.param([0.35, 1.0], "crop_scale", [0.35, 1.0], id="json-array-value"),
    pytest.param("True", "monitor", True, id="str-True"),
    pytest.param("False", "monitor", False, id="str-False"),
    pytest.param("false", "monitor", False, id="json-false"),
    pytest.param("64", "batch_size", 64, id="int-as-string"),
    pytest.param("5e-05", "lr", 5e-05, id="float-as-string"),
    pytest.param('"tiny"', "model", "tiny", id="json-string"),
    pytest.param("google/vit-base-patch16-224", "model", "google/vit-base-patch16-224", id="plain-string"),
    pytest.param("0.35 1.0", "crop_scale", [0.35, 1.0], id="space-separated-pair"),
    pytest.param("0.35, 1.0", "crop_scale", [0.35, 1.0], id="comma-separated-pair"),
    pytest.param("1.0", "epochs", 1, id="integral-float-for-an-integer"),
    pytest.param("1e0", "epochs", 1, id="exponent-for-an-integer"),
    pytest.param(2.0, "epochs", 2, id="json-float-for-an-integer"),
    pytest.param("2.0", "devices", 2, id="integral-float-for-an-integer-or-auto"),
    pytest.param("1e-3", "lr", 1e-3, id="exponent-for-a-float"),
])
def test_every_value_form_the_sdks_send(tmp_path, raw, field, want):
    """JSON, Python's str() of a list or tuple, True/False and numbers as strings all land on the setting."""
    from dali_pipe.cli import parse_train

    key = {"crop_scale": "crop-scale", "monitor": "monitor", "batch_size": "batch-size", "lr": "lr",
           "model": "model", "epochs": "epochs", "devices": "devices"}[field]
    argv, _ = hyperparameter_argv({key: raw})
    s = parse_train(argv)
    group = {"crop_scale": s.pipeline, "monitor": s.run, "batch_size": s.data, "lr": s.model, "model": s.model,
             "epochs": s.model, "devices": s.run}[field]
    assert getattr(group, field) == want and type(getattr(group, field)) is type(want)
    if field == "crop_scale":
        assert argv == ["--crop-scale", "0.35", "1.0"] or argv == ["--crop-scale", "0.35", "1"]


@pytest.mark.parametrize("raw", ["1.5", "1.5e0", 1.5])
def test_a_value_that_does_not_fit_is_named_as_written(raw):
    """An integer setting given a fraction is refused, naming the value as hyperparameters.json holds it (not
    a converted '1.5' for '1.5e0')."""
    from dali_pipe.cli import parse_train
    from dali_pipe.cli.sagemaker import hyperparameters
    from dali_pipe.config import UsageError

    argv, _ = hyperparameter_argv({"epochs": raw})
    with pytest.raises(UsageError) as e:
        parse_train(argv)
    assert f"\"epochs\": {str(raw)!r} is not an integer" in hyperparameters(str(e.value))


def test_a_misspelt_key_gets_the_closest_key_and_no_unrelated_advice():
    from dali_pipe.cli.sagemaker import SageMakerError

    with pytest.raises(SageMakerError) as e:
        hyperparameter_argv({"epoch": "3", "learning-rate-schedule": "x", "hf_token": "x"})
    lines = str(e.value).splitlines()[1:]
    assert lines[0].strip() == "unknown hyperparameter 'epoch' (did you mean 'epochs'?)"
    assert "secrets" not in lines[1] and "python train.py --help" in lines[1]
    assert "Pass secrets through the estimator's environment" in lines[2]  # a key that looks like a secret


def test_a_string_that_only_looks_like_a_list_stays_a_string():
    """'(a, b)' (no Python literal) and nested tuples are passed on as they are, so the flag's own check
    names them."""
    from dali_pipe.cli.sagemaker import _unwrap

    assert _unwrap("(a, b)") == "(a, b)" and _unwrap("(1, (2,))") == "(1, (2,))" and _unwrap("()") == []


# -- how the container may be started --------------------------------------------------------------------
def test_serve_answers_one_clear_line(capsys):
    """`serve` (SageMaker hosting) gets one line saying this image trains, exit status 2."""
    from dali_pipe.cli import cli, main

    assert cli(lambda: main(["serve"])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "this image trains and does not serve" in err


def test_train_outside_a_job_stops_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """No /opt/ml/input/config and no SAGEMAKER_BASE_DIR: one line naming both ways out, nothing under
    /opt/ml; a SAGEMAKER_BASE_DIR without input/config is refused the same way, writing nothing there."""
    from dali_pipe.cli import cli, main

    if Path("/opt/ml/input/config").exists():
        pytest.skip("this machine has a /opt/ml/input/config")
    monkeypatch.delenv("SAGEMAKER_BASE_DIR", raising=False)
    existed = Path("/opt/ml").exists()
    assert cli(lambda: main(["train"])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "there is no job here: /opt/ml/input/config does not exist" in err
    assert "SAGEMAKER_BASE_DIR" in err and Path("/opt/ml").exists() == existed
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path))
    assert cli(lambda: main(["train"])) == 2
    assert list(tmp_path.iterdir()) == [] and f"{tmp_path}/input/config does not exist" in capsys.readouterr().err


def test_a_job_is_recognised_by_its_name_or_its_hyperparameters(tmp_path, monkeypatch):
    """No arguments means the contract inside a job (TRAINING_JOB_NAME, or input/config/hyperparameters.json
    under the base) and the demo elsewhere."""
    from dali_pipe.cli.sagemaker import in_job

    monkeypatch.delenv("TRAINING_JOB_NAME", raising=False)
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path))
    assert not in_job()
    (tmp_path / "input" / "config").mkdir(parents=True)
    (tmp_path / "input" / "config" / "hyperparameters.json").write_text("{}")
    assert in_job()
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("TRAINING_JOB_NAME", "job-1")
    assert in_job()


def test_help_names_the_cache_path_the_contract_uses():
    """--help's SageMaker cache dir is where the contract puts it."""
    from dali_pipe.cli import train_parser
    from dali_pipe.cli.sagemaker import CACHE_DIR

    assert f"/opt/ml/{CACHE_DIR}" in " ".join(train_parser().format_help().split())
    argv, _ = build_argv(Path("/opt/ml"), [], {})
    assert argv[argv.index("--cache-dir") + 1] == f"/opt/ml/{CACHE_DIR}"


def test_a_successful_rerun_leaves_no_earlier_failure(tmp_path, monkeypatch):
    """output/failure from an earlier attempt on the same folder (SAGEMAKER_BASE_DIR reused) is gone once the
    contract runs again, so a job that then succeeds does not report the old reason."""
    from dali_pipe.cli.sagemaker import run_sagemaker

    (tmp_path / "input" / "config").mkdir(parents=True)
    (tmp_path / "input" / "config" / "hyperparameters.json").write_text('{"model": "tiny"}')
    (tmp_path / "output").mkdir()
    (tmp_path / "output" / "failure").write_text("invalid hyperparameters: the old reason")
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path))
    seen = []
    assert run_sagemaker([], lambda argv, **kw: seen.append(argv) or {"global_step": 1}) == {"global_step": 1}
    assert seen and not (tmp_path / "output" / "failure").exists()


def test_none_as_the_generic_estimator_writes_it_is_refused_as_null():
    """SDK 2.x's Estimator writes a None hyperparameter as the text 'None' (its PyTorch estimator as 'null'):
    both are refused the same way, naming the key, before any flag reads 'None' as a value."""
    from dali_pipe.cli.sagemaker import SageMakerError

    for raw in ("None", "null"):
        with pytest.raises(SageMakerError) as e:
            hyperparameter_argv({"clip-grad-norm": raw, "model": raw})
        assert "hyperparameter 'clip-grad-norm' is null" in str(e.value) and "'model' is null" in str(e.value)
