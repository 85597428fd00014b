"""Write the SageMaker SDK's own local-mode job layouts as test fixtures (run by hand, not by the suite).

The SDK is not a dependency of this project: run this in a throwaway venv that has it, once per SDK:

    python3 -m venv /tmp/sm2 && /tmp/sm2/bin/pip install 'sagemaker<3' && /tmp/sm2/bin/python tests/sagemaker_sdk/make_fixtures.py
    python3 -m venv /tmp/sm3 && /tmp/sm3/bin/pip install 'sagemaker>=3' && /tmp/sm3/bin/python tests/sagemaker_sdk/make_fixtures.py

It runs the SDK's local mode for real (Estimator.fit / ModelTrainer.train with instance_type "local")
and stops it where it would start `docker compose up`: the SDK has by then written, for each host,
input/config/{hyperparameters,inputdataconfig,resourceconfig}.json and the docker-compose.yaml
(volumes, command or entrypoint, environment). Those files are copied under tests/sagemaker_sdk/CASE/,
with the SDK's temporary folders replaced by ${ROOT} and ${DATA}, and the AWS credentials it passes
replaced by ${AWS_...} (the values here are dummies anyway). tests/test_sagemaker_sdk.py lays the job
out exactly as those volumes say and runs the contract against it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Every value form an SDK sends: a tuple (v2's generic Estimator sends str() of it), a bool, floats, ints,
# a plain string. One epoch of the tests' 48 photos keeps the run short.
HYPERPARAMETERS = {"model": "tiny", "epochs": 1, "batch-size": 8, "device": "cpu", "num-threads": 1,
                   "crop-scale": (0.35, 1.0), "monitor": False, "lr": 0.002, "val-fraction": 0.25}
ROLE = "arn:aws:iam::111111111111:role/SageMakerRole"
IMAGE = "dali-pipe:latest"


class Stop(Exception):
    """Raised where the SDK would run docker compose."""


def _env() -> None:
    """Dummy credentials, and the SDK's telemetry off (it would call AWS)."""
    config = Path(tempfile.mkdtemp()) / "config.yaml"
    config.write_text("SchemaVersion: '1.0'\nSageMaker:\n  PythonSDK:\n    Modules:\n      TelemetryOptOut: true\n")
    os.environ.update(AWS_DEFAULT_REGION="us-east-1", AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      SAGEMAKER_USER_CONFIG_OVERRIDE=str(config))
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)


def _capture(case: str, container_root: str, data: str, version: str, how: str) -> None:
    dest = HERE / case
    shutil.rmtree(dest, ignore_errors=True)
    root = Path(container_root)
    for cfg in root.glob("*/input/config/*.json"):
        rel = cfg.relative_to(root)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cfg, dest / rel)
    text = (root / "docker-compose.yaml").read_text().replace(container_root, "${ROOT}").replace(data, "${DATA}")
    text = re.sub(r"(AWS_(ACCESS_KEY_ID|SECRET_ACCESS_KEY|SESSION_TOKEN))=\S+", r"\1=${\1}", text)
    text = re.sub(r"/tmp/tmp\w+", "${CODE}", text)  # the source_dir a framework estimator mounts
    (dest / "docker-compose.yaml").write_text(text)
    (dest / "SDK.json").write_text(json.dumps({"sdk": f"sagemaker {version}", "how": how}, indent=1) + "\n")
    print(f"{case}: written by sagemaker {version} ({how})")


def _stop_before_compose(image_module, case: str, data: str, version: str, how: str):
    """Patch the local-mode module: docker compose is 'there', and running it copies the files and stops."""
    image_module._SageMakerContainer._get_compose_cmd_prefix = staticmethod(lambda: ["docker", "compose"])
    real_popen = subprocess.Popen

    def popen(cmd, *args, **kwargs):
        if list(cmd[:2]) == ["docker", "compose"]:
            compose = Path(cmd[cmd.index("-f") + 1])
            _capture(case, str(compose.parent), data, version, how)
            raise Stop()
        return real_popen(cmd, *args, **kwargs)

    image_module.subprocess.Popen = popen


def sdk_v2(data: str) -> None:
    import sagemaker
    from sagemaker.estimator import Estimator
    from sagemaker.local import LocalSession, image

    for count in (1, 2):
        case = f"v2-estimator-{count}host"
        _stop_before_compose(image, case, data, sagemaker.__version__,
                             f"Estimator(image_uri, instance_type='local', instance_count={count}).fit("
                             "{'training': 'file://DATA'})")
        session = LocalSession()
        session.config = {"local": {"local_code": True}}
        est = Estimator(image_uri=IMAGE, role=ROLE, instance_type="local", instance_count=count,
                        hyperparameters=HYPERPARAMETERS, output_path="file://" + tempfile.mkdtemp(),
                        sagemaker_session=session, environment={"HF_HUB_OFFLINE": "1"})
        try:
            est.fit({"training": f"file://{data}"}, wait=True, logs=False)
        except Stop:
            pass
    # A framework estimator JSON-encodes every value and adds its sagemaker_* keys.
    from sagemaker.pytorch import PyTorch

    code = Path(tempfile.mkdtemp())
    (code / "train.py").write_text("")
    _stop_before_compose(image, "v2-pytorch-1host", data, sagemaker.__version__,
                         "PyTorch(entry_point='train.py', image_uri, instance_type='local').fit({'training': 'file://DATA'})")
    session = LocalSession()
    session.config = {"local": {"local_code": True}}
    est = PyTorch(entry_point="train.py", source_dir=str(code), image_uri=IMAGE, role=ROLE, instance_type="local",
                  instance_count=1, framework_version="2.3", py_version="py311", hyperparameters=HYPERPARAMETERS,
                  output_path="file://" + tempfile.mkdtemp(), sagemaker_session=session)
    try:
        est.fit({"training": f"file://{data}"}, wait=True, logs=False)
    except Stop:
        pass


def sdk_v3(data: str) -> None:
    from importlib.metadata import version

    from sagemaker.train import ModelTrainer
    from sagemaker.train.configs import Compute, InputData
    from sagemaker.train.local import local_container
    from sagemaker.train.model_trainer import Mode

    sdk = version("sagemaker")
    local_container._LocalContainer._get_compose_cmd_prefix = lambda self: ["docker", "compose"]
    local_container._compose_cmd_prefix = ["docker", "compose"]
    real_popen = subprocess.Popen

    def popen(cmd, *args, **kwargs):
        if list(cmd[:2]) == ["docker", "compose"]:
            compose = Path(cmd[cmd.index("-f") + 1])
            _capture("v3-modeltrainer-1host", str(compose.parent), data, sdk,
                     "ModelTrainer(training_image, training_mode=Mode.LOCAL_CONTAINER, no command).train("
                     "input_data_config=[InputData(channel_name='training', data_source=DATA)])")
            raise Stop()
        return real_popen(cmd, *args, **kwargs)

    local_container.subprocess.Popen = popen
    root = tempfile.mkdtemp()
    trainer = ModelTrainer(training_image=IMAGE, training_mode=Mode.LOCAL_CONTAINER, role=ROLE,
                           compute=Compute(instance_type="local_cpu", instance_count=1),
                           hyperparameters=HYPERPARAMETERS, local_container_root=root,
                           environment={"HF_HUB_OFFLINE": "1"})
    try:
        trainer.train(input_data_config=[InputData(channel_name="training", data_source=data)], wait=True,
                      logs=False)
    except Stop:
        pass


def main() -> None:
    _env()
    data = tempfile.mkdtemp(prefix="sm-data-")
    (Path(data) / "dataset.tsv").write_text("image_path\n")
    from importlib.metadata import version

    major = int(version("sagemaker").split(".")[0])
    (sdk_v2 if major < 3 else sdk_v3)(data)


if __name__ == "__main__":
    sys.exit(main())
