"""The SageMaker bring-your-own-container contract: `docker run IMAGE train`.

How SageMaker starts the container, and what each way does:
- `train` as the first argument (the service, SDK 2.x local mode): this contract;
- no arguments inside a job (SDK 3.x `ModelTrainer` without a command; the image has no CMD): detected
  from TRAINING_JOB_NAME or input/config/hyperparameters.json, then this contract;
- `serve`: one line saying that this image trains and does not serve, exit status 2;
- `train` outside a job (no input/config under $SAGEMAKER_BASE_DIR or /opt/ml): one line, nothing written.

Maps /opt/ml (or $SAGEMAKER_BASE_DIR) onto train.py's settings and hands them to the same parser:
- input/config/hyperparameters.json: keys are the CLI flags ("batch-size", "batch_size" or
  "--batch-size"); values are strings, JSON as v2's framework estimators send them ("\\"tiny\\"",
  "[0.35, 1.0]", "true") and v3's ModelTrainer sends all but strings ("tiny", "[0.35, 1.0]"), Python's
  str() as v2's generic Estimator sends them ("(0.35, 1.0)", "True"), or written by hand ("0.35 1.0",
  1.0). A whole number written as a float ("1.0", "1e0") is an integer where the setting is one; a value
  that does not fit is named as it was written. Keys the SDK and tuning jobs add (`sagemaker_*`,
  `_tuning_objective_metric` and other `_`-prefixed ones) are ignored with one note; an unknown key is an
  error naming it and the closest flag; `null` is refused, naming the key. Messages name the settings
  as hyperparameters ("batch-size"), not as flags.
- input/config/inputdataconfig.json: data from the `training` channel (input/data/training, File or
  FastFile mode), unless a `data` hyperparameter names an s3:// URI;
- input/config/resourceconfig.json: several hosts -> MASTER_ADDR (first host), NODE_RANK,
  --num-nodes, and all local GPUs; the hosts meet first (hosts.py) and only node rank 0 touches model/;
- model/ gets the save_pretrained model + label map and nothing else of ours; output/data the scan
  report (bad_images.tsv, uploaded as output.tar.gz), output/tensorboard the logs,
  /opt/ml/checkpoints the spot-safe checkpoints (SageMaker syncs them to S3);
- any failure writes a short reason to output/failure (<= 1024 chars, redacted; a user error's or a
  failed run's message only, other failures their last traceback lines) and exits 1; a checkpoint in
  /opt/ml/checkpoints (restored from the job's checkpoint_s3_uri) of another run, or of other
  hyperparameters, is such a failure, with the ways out in SageMaker's terms.
The sagemaker-training toolkit's SM_* variables are honoured as defaults.
"""
from __future__ import annotations

import ast
import difflib
import json
import os
import re
import sys
import traceback
import typing
from pathlib import Path

from ..config import FIELDS, TRAIN_GROUPS, RunSettings, flag_of
from ..errors import RunFailed, RunMismatchError, UserError
from ..naming import named
from ..redact import redact, redact_argv
from ..workdir import write_atomic
from .hosts import HostsError, current, join

FAILURE_LIMIT = 1024
CONTRACT_FLAGS = ("--output", "--log-dir", "--report-dir", "--checkpoint-dir")  # set by the contract, not by users
INPUT_MODES = ("File", "FastFile")  # both put the channel under input/data/<channel>
CACHE_DIR = "input/data/dali_pipe_cache"  # under /opt/ml: the instance storage AWS documents for datasets


class SageMakerError(UserError):
    """The job's configuration is unusable; the message names the file or hyperparameter."""


def _flag(key) -> str:
    """The CLI flag a hyperparameter key names: 'batch_size', 'batch-size' and '--batch-size' alike."""
    return "--" + str(key).lstrip("-").replace("_", "-")


def _read_json(path: Path):
    """The file's JSON, or {} where SageMaker did not write it (a local run may omit any of them)."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise SageMakerError(f"{path} is not valid JSON ({e})") from None


def _unwrap(value):
    """A hyperparameter value as the CLI wants it. Framework estimators (v2 `PyTorch`) and v3 `ModelTrainer`
    JSON-encode values ('"tiny"', '[0.35, 1.0]', 'false'); v2's generic `Estimator` sends Python's str() of
    each ('(0.35, 1.0)', "['a', 'b']", 'False'); anything else is a plain string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            pass
        text = value.strip()
        if text[:1] in "([" and text[-1:] in ")]":
            try:
                seq = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return value
            if isinstance(seq, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in seq):
                return list(seq)
        return value
    return value


def _as_args(value, raw, name: str) -> list[str]:
    """The argv words of setting `name` from its unwrapped value (`raw`: as hyperparameters.json holds it)."""
    meta, tp = FIELDS[name][1].metadata, FIELDS[name][2]
    if isinstance(value, bool):
        return [str(value).lower()]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    if isinstance(value, str) and meta["nargs"]:  # a pair written as "0.35 1.0" (or "0.35, 1.0")
        return value.replace(",", " ").split()
    if isinstance(value, (int, float)):
        if isinstance(value, float) and value.is_integer() and int in _types(tp):
            return [str(int(value))]  # "1.0", "1e0" for --epochs: the integer
        return [str(raw).strip()]  # the number as written: a message names it so ("1.5", not 1.5 converted)
    return [str(value)]


def _types(tp) -> tuple:
    """The types a setting's annotation allows (int | None -> (int, NoneType))."""
    return typing.get_args(tp) or (tp,)


SECRET_LIKE = re.compile(r"token|secret|passw|key|credential|auth", re.I)


def hyperparameter_argv(hp: dict) -> tuple[list[str], list[str]]:
    """(argv, ignored keys) from hyperparameters.json; every problem listed in one SageMakerError."""
    known = {flag_of(n): n for n, (g, f, _) in FIELDS.items() if g in TRAIN_GROUPS and not f.metadata["positional"]}
    argv, ignored, problems = [], [], []
    for key, raw in hp.items():
        key = str(key)
        if key.startswith(("sagemaker_", "_")):
            ignored.append(key)
            continue
        flag = _flag(key)
        if flag in CONTRACT_FLAGS:
            problems.append(f"hyperparameter {key!r} is set by the SageMaker contract (model/, output/, "
                            "output/data, /opt/ml/checkpoints); remove it")
            continue
        if flag not in known:
            close = difflib.get_close_matches(flag, sorted(known), n=1)
            if close:
                problems.append(f"unknown hyperparameter {key!r} (did you mean {close[0][2:]!r}?)")
            else:
                problems.append(f"unknown hyperparameter {key!r}; the keys are train.py's flags (python train.py "
                                "--help)" + (". Pass secrets through the estimator's environment, not hyperparameters"
                                             if SECRET_LIKE.search(key) else ""))
            continue
        value = None if raw == "None" else _unwrap(raw)  # v2's Estimator writes str(None); its PyTorch, null
        if value is None:
            problems.append(f"hyperparameter {key!r} is null (None); give it a value or remove it to keep the "
                            "default")
            continue
        argv += [flag, *_as_args(value, raw, known[flag])]
    if problems:
        raise SageMakerError("invalid hyperparameters:\n  " + "\n  ".join(problems))
    return argv, ignored


def build_argv(base: Path, extra: list[str], env: dict) -> tuple[list[str], dict]:
    """The train.py argv and the distributed environment for this host."""
    cfg = base / "input" / "config"
    hp = _read_json(cfg / "hyperparameters.json")
    if not isinstance(hp, dict):
        raise SageMakerError(f"{cfg / 'hyperparameters.json'} must hold a JSON object of flag -> value")
    channels = _read_json(cfg / "inputdataconfig.json")
    resources = _read_json(cfg / "resourceconfig.json")

    argv, ignored = hyperparameter_argv(hp)
    if ignored:
        print(f"sagemaker: ignoring {len(ignored)} key(s) set by SageMaker itself: {', '.join(sorted(ignored))}")
    given = {a for a in argv if a.startswith("--")}

    if "--data" not in given:
        channel = Path(env.get("SM_CHANNEL_TRAINING", base / "input" / "data" / "training"))
        if channels and "training" not in channels:
            raise SageMakerError(f"inputdataconfig.json has channels {sorted(channels)} but no 'training'; name the "
                                 "channel 'training' or pass a 'data' hyperparameter with an s3:// URI")
        mode = (channels.get("training") or {}).get("TrainingInputMode", "File")
        if mode not in INPUT_MODES:
            raise SageMakerError(f"the training channel uses TrainingInputMode {mode!r}; use File or FastFile "
                                 "(or pass a 'data' hyperparameter with an s3:// URI)")
        argv += ["--data", str(channel)]

    model_dir = Path(env.get("SM_MODEL_DIR", base / "model"))
    data_dir = Path(env.get("SM_OUTPUT_DATA_DIR", base / "output" / "data"))
    argv += ["--output", str(model_dir), "--log-dir", str(base / "output" / "tensorboard"),
             "--report-dir", str(data_dir), "--checkpoint-dir", str(base / "checkpoints")]
    if "--cache-dir" not in given:
        argv += ["--cache-dir", str(base / CACHE_DIR)]

    dist_env = host_env(resources, env)
    num_gpus = int(env.get("SM_NUM_GPUS", "-1"))
    if dist_env:
        argv += ["--num-nodes", str(len(json.loads(dist_env["DALI_PIPE_HOSTS"])))]
    if "--devices" not in given and num_gpus != 0:
        argv += ["--devices", "auto" if num_gpus < 0 else str(num_gpus)]
    return argv + extra, dist_env


def host_env(resources: dict, env: dict) -> dict:
    """The distributed environment of this host when the job has several: MASTER_ADDR (the first host in
    sorted order), MASTER_PORT, NODE_RANK and DALI_PIPE_HOSTS (the names, for messages); {} for one host."""
    hosts = resources.get("hosts") or json.loads(env.get("SM_HOSTS", "[]") or "[]")
    current = resources.get("current_host") or env.get("SM_CURRENT_HOST")
    if len(hosts) <= 1:
        return {}
    hosts = sorted(hosts)
    if current not in hosts:
        raise SageMakerError(f"resourceconfig.json: current_host {current!r} is not in hosts {hosts}")
    return {"MASTER_ADDR": hosts[0], "MASTER_PORT": env.get("MASTER_PORT", "29500"),
            "NODE_RANK": str(hosts.index(current)), "DALI_PIPE_HOSTS": json.dumps(hosts)}


def _dist_timeout(hp: dict) -> float:
    """--dist-timeout from the hyperparameters when it reads as a number, else its default (for joining
    the other hosts before the hyperparameters are checked; a bad value is reported with the others)."""
    for key, raw in hp.items():
        if _flag(key) == "--dist-timeout":
            try:
                return float(_unwrap(raw))
            except (TypeError, ValueError):
                break
    return float(RunSettings.dist_timeout)


def base_dir() -> Path:
    """The job's root: $SAGEMAKER_BASE_DIR, else /opt/ml."""
    return Path(os.environ.get("SAGEMAKER_BASE_DIR", "/opt/ml"))


def in_job() -> bool:
    """Inside a SageMaker training job (started with no command, as SDK 3's ModelTrainer does): the
    service sets TRAINING_JOB_NAME and writes input/config/hyperparameters.json."""
    return bool(os.environ.get("TRAINING_JOB_NAME")) or \
        (base_dir() / "input" / "config" / "hyperparameters.json").is_file()


SERVE_MESSAGE = ("this image trains and does not serve: deploy the model SageMaker saved as model.tar.gz (model/ "
                 "in save_pretrained form) with an inference container, e.g. Hugging Face's, or run "
                 "`python -m dali_pipe predict`")


def write_failure(output_dir: Path, reason: str) -> None:
    """output/failure: the reason, redacted and bounded. A folder that cannot take it is said in one line
    (the reason itself is printed by the caller), never a traceback hiding the reason."""
    text = redact(reason.strip())
    if len(text) > FAILURE_LIMIT:
        text = text[: FAILURE_LIMIT - 3] + "..."
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(output_dir / "failure", text)
    except OSError as e:
        print(f"sagemaker: could not write {output_dir / 'failure'} ({e.strerror or e})", file=sys.stderr)


def run_sagemaker(extra: list[str], main) -> dict:
    """Run train.py's `main` as a SageMaker job; on failure write output/failure and exit 1.

    Outside a job (no input/config under $SAGEMAKER_BASE_DIR or /opt/ml) it stops with one line and
    writes nothing. With several hosts, this host first joins the others (dali_pipe/cli/hosts.py), so
    that a failure at any later point is published to them."""
    base = base_dir()
    if not (base / "input" / "config").is_dir():
        where = ("SAGEMAKER_BASE_DIR is set to " + str(base)) if "SAGEMAKER_BASE_DIR" in os.environ else \
            "SAGEMAKER_BASE_DIR is unset"
        raise SageMakerError(f"`train` runs the SageMaker training contract, but there is no job here: "
                             f"{base / 'input' / 'config'} does not exist ({where}). To run the contract without "
                             "Docker, lay out a folder as /opt/ml is laid out (docs/sagemaker.md) and set "
                             "SAGEMAKER_BASE_DIR to it; to train directly: python train.py --data DIR")
    failure_dir = base / "output"
    try:
        (failure_dir / "failure").unlink(missing_ok=True)  # an earlier attempt's (a rerun on the same folder)
    except OSError:
        pass
    try:
        cfg = base / "input" / "config"
        dist_env = host_env(_read_json(cfg / "resourceconfig.json"), dict(os.environ))
        os.environ.update(dist_env)
        if dist_env and os.environ.get("LOCAL_RANK", "0") == "0":  # Lightning's other local ranks do not join
            hp = _read_json(cfg / "hyperparameters.json")
            join(len(json.loads(dist_env["DALI_PIPE_HOSTS"])), _dist_timeout(hp if isinstance(hp, dict) else {}))
        argv, _ = build_argv(base, extra, dict(os.environ))
        print(f"sagemaker: base {base}; train.py {' '.join(redact_argv(argv))}", flush=True)
        return main(argv, style="hyperparameter")
    except SystemExit as e:
        if e.code in (0, None):  # --help
            raise
        reason = getattr(e, "reason", None) or \
            ("stopped by SIGTERM" if e.code == 143 else f"exited with status {e.code}")
        _tell_hosts(current(), reason, linger=e.code != 143)
        write_failure(failure_dir, reason)
        raise
    except BaseException as e:
        meeting = current()
        if isinstance(e, KeyboardInterrupt) and meeting is not None and meeting.interrupted_by:
            e = HostsError(meeting.interrupted_by)  # another host failed first: name it, not the interrupt
        elif isinstance(e, KeyboardInterrupt):  # Ctrl-C (docker run -it): said and exited as without SageMaker (130)
            _tell_hosts(meeting, "stopped by Ctrl-C", linger=False)
            write_failure(failure_dir, "stopped by Ctrl-C")
            raise
        if isinstance(e, RunMismatchError):
            e = RunMismatchError(f"{e}\n  Under SageMaker: give this job another checkpoint_s3_uri (its checkpoints "
                                 "are restored to /opt/ml/checkpoints), or the hyperparameter \"resume\": \"never\".")
        if isinstance(e, (UserError, RunFailed)):  # its settings named as the job names them: "batch-size"
            e.args = (hyperparameters(str(e)),) + e.args[1:]
            reason = str(e)
        else:
            reason = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exc().splitlines(True)[-6:])
        _tell_hosts(current(), " ".join(str(e).split()) if isinstance(e, (UserError, RunFailed)) else
                    f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")
        write_failure(failure_dir, reason)
        print(f"error: {redact(e)}", file=sys.stderr)
        sys.exit(1)


def hyperparameters(text: str) -> str:
    """A message of ours with train.py's settings named as hyperparameters ("batch-size": 24)."""
    return named(text, "hyperparameter", [n for n, (g, _, _) in FIELDS.items() if g in TRAIN_GROUPS])


def _tell_hosts(meeting, reason: str, *, linger: bool = True) -> None:
    """Publish this host's failure to the other hosts (redacted, one line)."""
    if meeting is not None:
        meeting.fail(redact(" ".join(reason.split())), linger=linger)
