"""The settings: one definition per setting, a generated parser, every problem listed at once."""
from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from dali_pipe import config
from dali_pipe.cli import parser as cli_parser
from dali_pipe.cli.parser import build_parser, parse, settings_from
from dali_pipe.config import FIELDS, Settings, UsageError, validate
from dali_pipe.inputs import data_problem

ROOT = Path(__file__).resolve().parents[1]


def _parse(argv, groups=config.TRAIN_GROUPS) -> Settings:
    ns, problems = parse(argv, build_parser("prog", "doc", groups))
    s = settings_from(ns)
    validate(s, groups, problems, data_check=data_problem)
    return s


def test_every_setting_has_a_flag_a_doc_and_its_default_in_help():
    """The parser is generated from the dataclasses: each field is a flag whose help is the field's doc."""
    p = build_parser("prog", "doc", config.TRAIN_GROUPS)
    actions = {a.dest: a for a in p._actions}
    for name, (group, f, _) in FIELDS.items():
        assert f.metadata["help"], name
        if group in config.TRAIN_GROUPS:
            assert actions[name].default == f.default and actions[name].help == f.metadata["help"]
    text = p.format_help()
    assert "--batch-size BATCH_SIZE" in text and "(default: 32)" in text
    assert "--scan {off,fast,full}" in text


def test_defaults_and_types_round_trip():
    s = _parse(["--batch-size", "64", "--lr", "3e-4", "--devices", "auto", "--skip-missing", "--monitor", "false"])
    assert (s.data.batch_size, s.model.lr, s.run.devices, s.data.skip_missing, s.run.monitor) == (64, 3e-4, "auto",
                                                                                                  True, False)
    assert s.data.val_fraction == config.DataSettings().val_fraction == 0.1
    assert _parse([]).model.epochs == 5


def test_every_problem_is_listed_with_flag_value_and_what_is_allowed(tmp_path):
    with pytest.raises(UsageError) as e:
        _parse(["--epochs", "banana", "--batch-size", "0", "--precision", "fp8", "--device", "tpu",
                "--val-fraction", "1.5", "--data", str(tmp_path / "nope"), "--scan", "deep", "--devices", "x",
                "--loaders", "dali,nope", "--max-steps", "0"])
    msg = str(e.value)
    for needle in ["--epochs: 'banana' is not an integer", "--batch-size: 0 must be at least 1",
                   "--precision: 'fp8' is not one of auto, 32-true, 16-mixed, bf16-mixed",
                   "--device: 'tpu' is not one of auto, gpu, cpu", "--val-fraction: 1.5 must be in [0, 1)",
                   "--data:", "--scan: 'deep' is not one of off, fast, full",
                   "--devices: 'x' is not an integer or 'auto'", "--loaders: 'dali,nope' has an unknown loader",
                   "--max-steps: 0 must be -1 (no limit) or at least 1"]:
        assert needle in msg, (needle, msg)


def test_seeds_outside_what_numpy_takes_and_an_empty_data_are_refused():
    """--seed -1 (DALI's 'random') or above 2**32 - 1 (numpy's and Lightning's bound) is named before any
    work, not a ValueError from seed_everything; --data '' is named too, not read as the current folder."""
    for bad in ("-1", str(2**32)):
        with pytest.raises(UsageError, match=f"--seed: {bad} must be between 0 and 4294967295"):
            _parse(["--seed", bad])
    assert _parse(["--seed", str(2**32 - 1)]).data.seed == 2**32 - 1
    with pytest.raises(UsageError, match="--data: '' is empty"):
        _parse(["--data", ""])


@pytest.mark.parametrize("argv", [["--epoch", "3"], ["pack", "a", "b", "--shard", "1MB"]])
def test_a_flag_is_named_whole_not_abbreviated(argv):
    """argparse's abbreviations are off, for train.py and the commands: `--epoch 3` is an unknown flag, where it
    was silently taken as --epochs."""
    from dali_pipe.cli import parse_train
    from dali_pipe.cli.commands import main

    with pytest.raises(UsageError, match=rf"unrecognized arguments: {argv[-2]}"):
        parse_train(argv) if argv[0] != "pack" else main(argv)


def test_unknown_flag_suggests_the_closest_and_joins_the_other_problems():
    with pytest.raises(UsageError) as e:
        _parse(["--batchsize", "8", "--epochs", "x"])
    msg = str(e.value)
    assert "unrecognized arguments: --batchsize (did you mean --batch-size?)" in msg
    assert "--epochs: 'x' is not an integer" in msg


def test_model_none_needs_benchmark():
    with pytest.raises(UsageError, match="'none' only makes sense with --benchmark"):
        _parse(["--model", "none"])
    assert _parse(["--model", "none", "--benchmark"]).model.model == "none"


def test_resolve_fills_computed_defaults_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DALI_PIPE_CACHE", str(tmp_path / "c"))
    s = config.resolve(_parse(["--device", "cpu", "--output", str(tmp_path / "o")]))
    assert s.data.cache_dir == str(tmp_path / "c") and s.model.model == config.TINY and s.model.lr == config.DEMO_LR
    assert s.model.precision == "32-true" and s.run.checkpoint_dir == str(tmp_path / "o" / "checkpoints")
    (tmp_path / "dataset.tsv").write_text("image_path\n")
    s = config.resolve(_parse(["--device", "cpu", "--data", str(tmp_path), "--model", "org/x"]))
    assert s.model.lr == config.FINETUNE_LR and s.model.model == "org/x"
    assert config.resolve(_parse(["--device", "cpu", "--data", str(tmp_path)])).model.model == config.DEFAULT_MODEL


def test_library_functions_take_settings_without_restating_their_defaults():
    """Each default lives in config.py only: the library's own signatures carry none of them."""
    from dali_pipe.manifest import read_manifest
    from dali_pipe.scan import scan
    from dali_pipe.sync import sync

    for fn, names in ((read_manifest, ["val_fraction", "seed", "skip_missing"]), (scan, ["max_pixels"]),
                      (sync, ["workers"])):
        params = inspect.signature(fn).parameters
        for n in names:
            assert params[n].default is inspect.Parameter.empty, (fn.__name__, n)
    for cls in (config.DataSettings, config.ModelSettings, config.RunSettings):
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING, f.name


def test_help_and_bad_flags_load_only_the_settings():
    """`--help` and a bad flag import none of the heavy libraries (they answer before any loads)."""
    code = ("import sys, runpy\nsys.argv = ['train.py', '--epochs', 'x']\n"
            "import train\nfrom dali_pipe.cli import cli\nrc = cli()\n"
            "heavy = [m for m in ('torch', 'pytorch_lightning', 'transformers', 'nvidia.dali', 'pandas', 'boto3')"
            " if m in sys.modules]\nprint('RC', rc, 'HEAVY', heavy)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert "RC 2 HEAVY []" in r.stdout, r.stdout + r.stderr
    assert "--epochs: 'x' is not an integer" in r.stderr
    r = subprocess.run([sys.executable, "train.py", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "--batch-size" in r.stdout


def test_train_mode_is_only_the_first_argument():
    """A flag's value never falls into the SageMaker 'train' mode; 'train' elsewhere is an unknown argument."""
    assert _parse(["--weight-decay", "0.05"]).model.weight_decay == 0.05
    with pytest.raises(UsageError, match="unrecognized arguments: train"):
        _parse(["--epochs", "2", "train"])


def test_a_pair_keyword_names_the_pair_it_needs():
    """A pair setting given as a keyword (crop_scale=0.5, or "0.35 1.0" as text) is read or refused as a pair:
    the message asks for two numbers, not for 'a number'."""
    from dali_pipe.config import field_problems, settings_from_keywords

    s = settings_from_keywords({"crop_scale": "0.35 1.0"}, ["crop_scale"])
    assert s.pipeline.crop_scale == (0.35, 1.0)
    for bad in (0.5, "0.5", (0.1, 0.2, 0.3)):
        s = settings_from_keywords({"crop_scale": bad}, ["crop_scale"])
        problems = field_problems(s, ["crop_scale"])
        assert len(problems) == 1 and "is not 2 numbers, such as (0.08, 1.0)" in problems[0], problems


def test_a_flag_written_as_a_bare_word_suggests_the_flag():
    """`train.py benchmark ...` (the flag without its dashes) is refused suggesting --benchmark."""
    ns, problems = parse(["benchmark", "--model", "tiny"], build_parser("train.py", ""))
    assert any("benchmark (did you mean --benchmark?)" in p for p in problems), problems


def test_data_urls_a_pipe_and_shard_files(tmp_path):
    """--data: a pipe: URL (which runs a command) and a scheme not read are refused in one line each, neither
    repeating the URL (it may carry a secret); https:// shard URLs, one shard file and a folder of train/ and val/
    shard folders are taken (not 'not a directory')."""
    problems = []
    for data in ("pipe:curl -s -H 'Authorization: Bearer tok3n' https://h/x-{0..3}.tar", "gs://mybkt/x.tar"):
        with pytest.raises(UsageError) as err:
            _parse(["--data", data])
        problems.append(str(err.value))
    assert "a pipe: URL runs a shell command" in problems[0] and "gs:// URLs are not read" in problems[1]
    assert not any(s in " ".join(problems) for s in ("tok3n", "mybkt", "curl")), problems
    (tmp_path / "x.tar.gz").write_bytes(b"")
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "part-0.tgz").write_bytes(b"")
    for data in ("https://h/shards-{000..009}.tar", str(tmp_path / "x.tar.gz"), str(tmp_path)):
        _parse(["--data", data])


def test_a_model_folder_that_does_not_exist_is_named_before_any_work(tmp_path):
    """--model /nonexistent (a path, never a hub id) is said not to exist, with what a model folder is, by
    train.py and by evaluate and predict; before, transformers' 'Repo id must be in the form' came ~10 s later."""
    from dali_pipe.cli import commands

    missing = str(tmp_path / "nonexistent")
    with pytest.raises(UsageError, match=r"--model: '.*nonexistent' does not exist; pass the folder a training run "
                                         r"wrote \(train.py's --output"):
        _parse(["--model", missing])
    for command in ("evaluate", "predict"):
        with pytest.raises(UsageError, match=r"--model: '.*nonexistent' does not exist"):
            commands.main([command, "--model", missing, "--data", str(tmp_path)])
    assert _parse(["--model", "org/name"]).model.model == "org/name"  # a hub id is never taken for a path


def test_every_data_pipeline_and_model_setting_says_whether_it_is_part_of_a_runs_identity():
    """Each field of DataSettings, PipelineSettings and ModelSettings is marked identity=RECIPE (its value is
    compared on resume), DATA (counted by the data's digest) or False; a new field without the mark fails here.
    The recipe is read from the settings objects (a pair as a list, as JSON gives it back), and the guarantees
    page names every recipe flag."""
    for name, (group, f, _) in FIELDS.items():
        if group in config.IDENTITY_GROUPS:
            assert f.metadata["identity"] in (config.RECIPE, config.DATA, False), name
    names = config.recipe_names()
    assert {"lr", "weight_decay", "warmup_fraction", "label_smoothing", "mixup_alpha", "cutmix_alpha", "crop_scale",
            "auto_augment", "random_erase", "clip_grad_norm", "precision", "model", "batch_size", "seed",
            "grad_accum"} <= set(names)
    assert not {"epochs", "max_steps", "num_threads", "device", "compile", "cache_dir"} & set(names)
    assert config.recipe(config.PipelineSettings())["crop_scale"] == [0.08, 1.0]
    guarantees = (ROOT / "docs" / "guarantees.md").read_text()
    assert [n for n in names if f"`{config.flag_of(n)}`" not in guarantees] == []


def test_every_float_setting_refuses_inf_and_nan():
    """inf, -inf and nan (as flags, SageMaker's "Infinity" and "NaN", or library floats) are refused for every
    float setting by one check, naming the flag."""
    from dali_pipe.cli.sagemaker import hyperparameter_argv
    from dali_pipe.config import field_problems, settings_from_keywords

    floats = [n for n, (g, f, tp) in FIELDS.items() if g in config.TRAIN_GROUPS and "float" in str(tp)]
    assert {"lr", "weight_decay", "clip_grad_norm", "crop_scale", "val_fraction", "hw_decoder_load"} <= set(floats)
    for value in ("inf", "-inf", "nan"):
        argv = [a for n in floats for a in ([f"{config.flag_of(n)}={value}"] if n != "crop_scale" else
                                            ["--crop-scale", value.lstrip("-"), "1"])]  # a pair: no "-inf" token
        with pytest.raises(UsageError) as e:
            _parse(argv)
        assert [n for n in floats if f"{config.flag_of(n)}: " not in str(e.value)] == [], str(e.value)
        assert "is not a finite number" in str(e.value)
    argv, _ = hyperparameter_argv({"lr": "Infinity", "label-smoothing": "NaN"})
    with pytest.raises(UsageError, match=r"--lr: inf is not a finite number\n  --label-smoothing: nan is not"):
        _parse(argv)
    s = settings_from_keywords({"random_erase": float("nan")}, ["random_erase"])
    assert field_problems(s, ["random_erase"]) == ["--random-erase: nan is not a finite number"]


def test_the_parser_records_which_settings_were_given():
    """`Settings.given` names the settings typed (a value equal to the default too), not the ones left at their
    defaults."""
    s = _parse(["--val-fraction", "0.3", "--seed", "0", "--lr", "1e-3"])
    assert s.given == {"val_fraction", "seed", "lr"} and s.data.val_fraction == 0.3
    assert _parse([]).given == frozenset()


@pytest.mark.parametrize("argv, want", [
    (["sync", "--no-progress", "s3://b/p", "dir"], ("s3://b/p", "dir", True, False)),
    (["sync", "s3://b/p", "--no-progress", "dir"], ("s3://b/p", "dir", True, False)),
    (["sync", "--no-progress", "false", "s3://b/p", "dir"], ("s3://b/p", "dir", False, False)),
    (["sync", "--skip-missing", "True", "--no-progress", "s3://b/p", "dir"], ("s3://b/p", "dir", True, True)),
    (["sync", "--no-progress=no", "--skip-missing", "s3://b/p", "dir"], ("s3://b/p", "dir", False, True)),
    (["sync", "--skip-missing", "--", "s3://b/p", "dir"], ("s3://b/p", "dir", False, True)),
])
def test_a_switch_takes_a_true_or_false_after_it_and_leaves_any_other_word(argv, want):
    """`--no-progress URI DIR` keeps its positionals (argparse's optional value would take the URI, and the
    command would ask for LOCAL_DIR), while `--skip-missing True` (SageMaker's strings) still sets a value."""
    p = cli_parser.new_parser("prog", "doc")
    cli_parser.add_subcommand(p.add_subparsers(dest="command"), "sync", "h", "doc", ("sync", "--skip-missing"))
    ns, problems = parse(argv, p)
    assert not problems
    assert (ns.uri, ns.local_dir, ns.no_progress, ns.skip_missing) == want


def test_manifest_force_before_its_folder():
    p = cli_parser.new_parser("prog", "doc")
    cli_parser.add_subcommand(p.add_subparsers(dest="command"), "manifest", "h", "doc", ("manifest",))
    ns, problems = parse(["manifest", "--force", "photos"], p)
    assert not problems and (ns.folder, ns.force) == ("photos", True)


@pytest.mark.parametrize("argv", [["sync", "--no-prog", "s3://b/p", "dir"], ["sync", "--skip", "s3://b/p", "dir"]])
def test_an_abbreviated_switch_is_an_unknown_flag(argv):
    """Abbreviations are off (#47: `--epoch` was taken as `--epochs`): an abbreviated switch is named as unknown."""
    p = cli_parser.new_parser("prog", "doc")
    cli_parser.add_subcommand(p.add_subparsers(dest="command"), "sync", "h", "doc", ("sync", "--skip-missing"))
    _, problems = parse(argv, p)
    assert problems == [f"unrecognized arguments: {argv[1]} (see prog --help)"]


@pytest.mark.parametrize("word", ["maybe", "", "t"])
def test_train_names_the_flag_of_a_switch_given_a_word_that_is_not_true_or_false(word):
    """train.py has no positionals: the word stays the switch's value, and its check names both (as a
    SageMaker hyperparameter `"skip-missing": "maybe"` is told)."""
    with pytest.raises(UsageError, match=f"--skip-missing.*'{word}' is not true or false"):
        _parse(["--skip-missing", word])


def test_an_output_that_is_the_data_or_inside_it_is_refused(photo_root, tmp_path):
    """train.py --output equal to an ImageFolder's --data trained, wrote checkpoints/ and tensorboard/ among the
    classes, and the next run said "2 class folder(s) hold no image ('checkpoints', 'tensorboard')"; evaluate and
    predict wrote into it as well. Each command now refuses it before anything is read, naming both flags."""
    import shutil

    import train
    from dali_pipe.cli.commands import main

    pets = tmp_path / "pets"
    shutil.copytree(photo_root, pets, ignore=shutil.ignore_patterns("dataset.tsv"))
    (tmp_path / "m").mkdir()
    with pytest.raises(UsageError, match=r"--output: '.*pets/' is --data \('.*pets'\): what the command writes there "
                                         r"is read as data by the next run.*pass an --output outside --data"):
        train.main(["--data", str(pets), "--output", f"{pets}/", "--model", "tiny", "--device", "cpu"])
    for command in ("evaluate", "predict"):
        with pytest.raises(UsageError, match=r"--output: '.*pets/../pets/out' is inside --data"):
            main([command, "--model", str(tmp_path / "m"), "--data", str(pets), "--output", f"{pets}/../pets/out"])
    assert sorted(p.name for p in pets.iterdir()) == sorted(p.name for p in photo_root.iterdir() if p.is_dir())
    from dali_pipe.cli import parse_train

    parse_train(["--data", str(pets), "--output", str(tmp_path / "runs")])  # beside it: fine
