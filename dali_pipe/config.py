"""Every setting of every command, defined once.

Each setting is a field of a typed dataclass below (data, pipeline, model and optimisation, run,
benchmark, and the per-command ones), with its default, a one-line doc and its check in `setting(...)`.
From these fields the CLI's parsers are generated (dali_pipe/cli/parser.py), the library's keywords and
SageMaker's hyperparameters are mapped (`settings_from_keywords`), and `validate()` checks them all at
once, listing every problem, each naming the flag, the bad value and what is allowed.

A leaf: it imports nothing heavy, and of the project only errors.py, so `--help` and a bad flag answer in
well under a second. The check of --data (the registry of input forms, which reads the settings) is
handed in by the caller (`validate(data_check=...)`).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError

# -- choices and built-in names (each defined here once) -------------------------------------
PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed")
DEVICES = ("auto", "gpu", "cpu")
SCAN_MODES = ("off", "fast", "full")
LOADERS = ("dali", "packed", "baseline", "synthetic")
AUTO_AUGMENTS = ("none", "rand", "trivial", "auto")  # RandAugment, TrivialAugmentWide, AutoAugment (ImageNet policy)
SELECT = ("best", "last")
SPLIT_CHOICES = ("val", "train", "test", "all")
DEFAULT_MODEL = "google/vit-base-patch16-224"
TINY = "tiny"  # small random-init ViT for CPU demos and tests
VIT_B16_RANDOM = "vit-b16-random"  # ViT-B/16 shape with random weights, for offline benchmarks
BUILTIN_MODELS = (TINY, VIT_B16_RANDOM)
DEMO_LR, FINETUNE_LR = 1e-3, 5e-5  # --lr default: built-in (random init) vs pretrained models


class UsageError(UserError):
    """Bad flags or hyperparameters; the message lists every problem."""


class Invalid:
    """A value that did not parse; kept so that validate() can list every problem at once."""

    def __init__(self, value: str, expected: str):
        self.value, self.expected = value, expected

    def __repr__(self) -> str:
        return f"Invalid({self.value!r})"


RECIPE, DATA = "recipe", "data"  # how a setting counts toward a run's identity (see `setting`)


def setting(default, help: str, *, parse=None, expected: str | None = None, check=None, choices=None,
            nargs=None, metavar: str | None = None, positional: bool = False, flag: str | None = None,
            identity: str | bool | None = None):
    """A settings field: its default, its one-line doc (the --help text) and how to read and check it.

    parse/expected: str -> value converter and the words for "is not {expected}" when it fails;
    check: (predicate, message) or a list of them, applied by validate();
    choices: the allowed values (validate() names them); flag: the CLI name when it differs;
    identity: whether the value changes what the weights become, so that a checkpoint or a model folder
    made with another value is another run: RECIPE (its value is compared), DATA (it changes which samples,
    labels or split a run reads, so the data's digest counts it), or False (it never changes the weights:
    speed, paths, reports). Every data, pipeline and model setting says which (tests/test_config.py).
    """
    meta = dict(help=help, parse=parse, expected=expected, check=check, choices=choices, nargs=nargs,
                metavar=metavar, positional=positional, flag=flag, identity=identity)
    return field(default=default, metadata=meta)


def parse_bool(s: str) -> bool:
    v = str(s).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(s)


def parse_int_or_auto(s: str):
    return "auto" if str(s).strip() == "auto" else int(s)


def parse_size(s: str) -> int:
    """'150MB', '1.5GiB', '500k' or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*", str(s), re.I)
    if not m:
        raise ValueError(s)
    power = " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


AT_LEAST_1 = (lambda v: v >= 1, "must be at least 1")
POSITIVE = (lambda v: v > 0, "must be positive")
FRACTION_0_1 = (lambda v: 0 <= v < 1, "must be in [0, 1)")
UNIT_INTERVAL = (lambda v: 0 <= v <= 1, "must be in [0, 1]")
NON_NEGATIVE = (lambda v: v >= 0, "must be 0 or more")
MAX_SEED = 2**32 - 1  # numpy's and Lightning's seed_everything's bound (DALI's -1 would mean a random seed)


def cores() -> int:
    """The CPU cores this process may use (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0))


# -- the settings -------------------------------------------------------------------------------
@dataclass
class DataSettings:
    """What to read, how to split it and how to check it."""
    data: str | None = setting(None, "the images, local or s3://bucket/prefix: a folder of class subfolders "
                                     "(ImageFolder; train/ + val/ of them), a folder with dataset.tsv, a pack, "
                                     "WebDataset shards (.tar, .tar.gz, .tgz: a folder of them or of train/ and "
                                     "val/ folders of them, one shard file, a pattern such as "
                                     "shards/train-{000000..000099}.tar, or https:// shard URLs), Parquet files or a "
                                     "save_to_disk folder of a Hugging Face dataset (docs/data.md); default: a "
                                     "generated demo set of real photos", identity=DATA)
    cache_dir: str | None = setting(None, "where s3:// data is synced and scan verdicts are cached; default "
                                          "$DALI_PIPE_CACHE or ~/.cache/dali_pipe (SageMaker: /opt/ml/input/"
                                          "data/dali_pipe_cache, on the instance volume)", identity=False)
    batch_size: int = setting(32, "images per batch per GPU/process", check=AT_LEAST_1, identity=RECIPE)
    val_fraction: float = setting(0.1, "validation share per class when the manifest has no split column",
                                  check=FRACTION_0_1, identity=DATA)
    seed: int = setting(0, "seed for the split, the sample order, augmentation and model init",
                        check=(lambda v: 0 <= v <= MAX_SEED, f"must be between 0 and {MAX_SEED} (the seeds numpy and "
                               "Lightning take)"), identity=RECIPE)
    scan: str = setting("fast", "pre-flight image scan", choices=SCAN_MODES, identity=DATA)
    max_pixels: int = setting(89_478_485, "reject images with more pixels (decompression bombs)", check=AT_LEAST_1,
                              identity=DATA)
    max_bad_fraction: float = setting(0.05, "abort when a larger share of images is bad", check=UNIT_INTERVAL,
                                      identity=False)
    image_column: str | None = setting(None, "Hugging Face datasets (Parquet, save_to_disk): the image column; "
                                             "default: the one column of the datasets Image type ({bytes, path})",
                                       identity=DATA)
    label_column: str | None = setting(None, "Hugging Face datasets: the label column; default: the one ClassLabel "
                                             "column, else the one named label or labels", identity=DATA)
    skip_missing: bool = setting(False, "go on without the files dataset.tsv lists but the data lacks (reported)",
                                 identity=DATA)
    packed_s3: str = setting("auto", "s3:// packed data: sync the shards to the cache dir when they fit on its disk "
                                     "(auto), always (sync), or stream them ahead of the reader through a bounded "
                                     "cache (stream; auto when they do not fit)",
                             choices=("auto", "sync", "stream"), identity=False)
    stream_cache: int | None = setting(None, "streamed packs: disk the shard cache may use per node (e.g. 20GB); "
                                             "default: half the cache dir's free space",
                                       parse=lambda v: parse_size(v), expected="a size such as 20GB", check=AT_LEAST_1,
                                       identity=False)


@dataclass
class PipelineSettings:
    """The DALI pipeline: where it runs and with how many threads."""
    device: str = setting("auto", "where DALI decodes and the model runs; auto picks the GPU when CUDA is "
                                  "available", choices=DEVICES, identity=False)
    num_threads: int | None = setting(None, "DALI CPU threads per process; default: the cores available to "
                                            "each local rank minus one, at most 8 (benchmark: all --cpus "
                                            "cores, as many as the baseline's workers)", check=AT_LEAST_1,
                                      identity=False)
    decoder_device_padding: int | None = setting(
        None, "GPU decoding: nvJPEG device memory pre-allocated per DALI thread (e.g. 64MB); default DALI's 16 MiB. "
              "Larger avoids re-allocations while the first large photos arrive, and costs threads x this on each GPU",
        parse=lambda v: parse_size(v), expected="a size such as 64MB", check=AT_LEAST_1, identity=False)
    decoder_host_padding: int | None = setting(
        None, "GPU decoding: pinned host memory pre-allocated per DALI thread; default DALI's 8 MiB",
        parse=lambda v: parse_size(v), expected="a size such as 32MB", check=AT_LEAST_1, identity=False)
    hw_decoder_load: float = setting(
        0.65, "GPU decoding: share of the JPEGs sent to the GPU's hardware JPEG decoder, where it has one (A100, "
              "H100); 0 decodes them all as a GPU without one does (T4, A10G)", check=UNIT_INTERVAL, identity=False)
    hybrid_huffman_threshold: int | None = setting(
        None, "GPU decoding: JPEGs above this many pixels go to nvJPEG's hybrid Huffman decoder, which DALI says "
              "\"still largely uses the CPU\", smaller ones to its host-side Huffman decoder (on the DALI CPU "
              "threads); 0 sends all to the hybrid one; default DALI's 1000000",
        check=NON_NEGATIVE, identity=False)
    crop_scale: tuple[float, float] = setting((0.08, 1.0), "training crop: the share of the image's area a random "
                                                           "crop covers, from MIN to MAX", nargs=2,
                                              metavar=("MIN", "MAX"),
                                              check=(lambda v: 0 < v[0] <= v[1] <= 1, "must be 0 < MIN <= MAX <= 1"),
                                              identity=RECIPE)
    auto_augment: str = setting("none", "training augmentation policy after the crop: RandAugment (rand), "
                                        "TrivialAugmentWide (trivial) or AutoAugment's ImageNet policy (auto)",
                                choices=AUTO_AUGMENTS, identity=RECIPE)
    ra_num_ops: int = setting(2, "RandAugment: operations per image", check=AT_LEAST_1, identity=RECIPE)
    ra_magnitude: int = setting(9, "RandAugment: magnitude, 0-30",
                                check=(lambda v: 0 <= v <= 30, "must be between 0 and 30"), identity=RECIPE)
    random_erase: float = setting(0.0, "training: probability of erasing a random rectangle (after normalising)",
                                  check=UNIT_INTERVAL, identity=RECIPE)


@dataclass
class ModelSettings:
    """The model and how it is optimised."""
    model: str | None = setting(None, f"hub id, local save_pretrained dir, '{TINY}', '{VIT_B16_RANDOM}', or "
                                      f"'none' (benchmark: loaders only); default: {TINY} for the demo set, "
                                      f"else {DEFAULT_MODEL}", identity=RECIPE)
    epochs: int = setting(5, "training epochs", check=AT_LEAST_1, identity=False)
    max_steps: int = setting(-1, "stop after this many optimizer steps (-1: no limit)",
                             check=(lambda v: v == -1 or v >= 1, "must be -1 (no limit) or at least 1"), identity=False)
    lr: float | None = setting(None, f"peak learning rate; default {DEMO_LR} for built-in models, "
                                     f"{FINETUNE_LR} for pretrained", check=POSITIVE, identity=RECIPE)
    weight_decay: float = setting(0.05, "AdamW weight decay (not applied to biases and norms)",
                                  check=NON_NEGATIVE, identity=RECIPE)
    warmup_fraction: float = setting(0.05, "share of the optimizer steps spent in linear warmup before "
                                           "the cosine decay", check=FRACTION_0_1, identity=RECIPE)
    label_smoothing: float = setting(0.0, "label smoothing of the training targets (composes with mixup/cutmix)",
                                     check=FRACTION_0_1, identity=RECIPE)
    mixup_alpha: float = setting(0.0, "mixup: Beta(alpha, alpha) mixing of image pairs in each batch (0: off)",
                                 check=NON_NEGATIVE, identity=RECIPE)
    cutmix_alpha: float = setting(0.0, "cutmix: Beta(alpha, alpha) boxes pasted between image pairs (0: off; "
                                       "with mixup, each batch takes one of the two)", check=NON_NEGATIVE,
                                  identity=RECIPE)
    grad_accum: int = setting(1, "batches per optimizer step (gradient accumulation)", check=AT_LEAST_1,
                              identity=RECIPE)
    clip_grad_norm: float | None = setting(None, "clip the gradient norm to this value (default: off)",
                                           check=POSITIVE, identity=RECIPE)
    compile: bool = setting(False, "torch.compile the model (first steps are slower while it compiles)", identity=False)
    precision: str = setting("auto", "auto: bf16-mixed on sm80+, 16-mixed on older GPUs (T4), 32-true on CPU",
                             choices=PRECISIONS, identity=RECIPE)


@dataclass
class RunSettings:
    """Where results go, checkpoints, and how many processes."""
    # none of these changes what the weights become (the number of processes counts as the run's world size)
    output: str = setting("runs/train", "output dir: model (save_pretrained form), bad_images.tsv, logs, "
                                        "benchmark files")
    log_dir: str | None = setting(None, "TensorBoard dir; default OUTPUT/tensorboard")
    report_dir: str | None = setting(None, "where bad_images.tsv goes; default OUTPUT (SageMaker: output/data, "
                                           "uploaded as output.tar.gz beside the model)")
    checkpoint_dir: str | None = setting(None, "checkpoints (resumed from when present); default "
                                               "OUTPUT/checkpoints (SageMaker: /opt/ml/checkpoints)")
    checkpoint_every_steps: int = setting(0, "also checkpoint every N optimizer steps (0: only at the end and "
                                             "on SIGTERM)", check=(lambda v: v >= 0, "must be 0 (off) or positive"))
    select: str = setting("best", "which model OUTPUT gets: the epoch with the best validation accuracy (ties: "
                                  "the later epoch; last when there is no validation data) or the last one",
                          choices=SELECT)
    resume: str = setting("auto", "auto: resume from CHECKPOINT_DIR/last.ckpt when it belongs to this run (the same "
                                  "data, processes and every setting that changes the weights: model, batch size, "
                                  "seed, optimizer, schedule, loss, augmentation, precision); never: start over, "
                                  "moving the old checkpoint aside; or the path of a checkpoint to resume",
                          check=(lambda v: v in ("auto", "never") or Path(v).is_file(),
                                 "is not auto, never or an existing checkpoint file"))
    monitor: bool = setting(False, "log GPU utilization and data-wait during training and print a diagnosis")
    devices: int | str = setting(1, "GPUs (or CPU processes) per node; 'auto': all local GPUs",
                                 parse=parse_int_or_auto, expected="an integer or 'auto'",
                                 check=(lambda v: v == "auto" or v >= 1, "must be at least 1 or 'auto'"))
    num_nodes: int = setting(1, "nodes in a multi-node run", check=AT_LEAST_1)
    dist_timeout: int = setting(1800, "multi-node: seconds a host waits for the others to arrive (after its own "
                                      "sync and scan) and for any collective, before the run fails naming the "
                                      "missing host", check=AT_LEAST_1)


@dataclass
class BenchmarkSettings:
    """Benchmark mode: loaders side by side, timed."""
    benchmark: bool = setting(False, "benchmark mode: time loaders side by side instead of training")
    loaders: str = setting("dali,baseline,synthetic", f"benchmark: comma-separated subset of {','.join(LOADERS)}",
                           check=(lambda v: bool(v) and all(x in LOADERS for x in v.split(",")),
                                  f"has an unknown loader; choose from {', '.join(LOADERS)}"))
    steps: int | None = setting(None, "benchmark: timed steps per loader (default: from the machine: 50 on a GPU, 6 "
                                      "on the CPU with a model, 30 for loaders alone)", check=AT_LEAST_1)
    warmup: int | None = setting(None, "benchmark: untimed warm-up steps per loader (default: from the machine: 10 "
                                       "on a GPU, 2 on the CPU with a model, 5 for loaders alone)", check=NON_NEGATIVE)
    cpus: int | None = setting(None, "benchmark: pin the process and its workers to this many cores (default: all; "
                                     "more than this process may use is cut to those, with a line saying so)",
                               check=AT_LEAST_1)
    packed: str | None = setting(None, "benchmark: a pack of --data (python -m dali_pipe pack) that the 'packed' "
                                       "loader reads with DALI, beside the raw files")
    repeat: int | None = setting(None, "benchmark: rounds; the loaders alternate within each round, and the report "
                                       "gives the median and min-max of each loader and of each ratio (default: from "
                                       "the machine: 3 on a GPU or for loaders alone, 2 on the CPU with a model)",
                                 check=AT_LEAST_1)
    allow_long: bool = setting(False, "benchmark: run even when the estimate on the CPU is over 10 minutes (without "
                                      "it such a run is refused before it starts, with the estimate)")

@dataclass
class SyncSettings:
    """`python -m dali_pipe sync`."""
    uri: str = setting(None, "s3://bucket/prefix of any --data form: a dataset.tsv folder, a pack, class folders, "
                             "shards, a Hugging Face dataset", positional=True)
    local_dir: str = setting(None, "target directory (created if needed)", positional=True)
    workers: int = setting(256, "S3 requests in flight at once (one event loop; also for uploads); the bytes they hold "
                                "are bounded apart (256 MiB)", check=AT_LEAST_1)
    no_progress: bool = setting(False, "no progress bar; print a summary line instead")


@dataclass
class PackSettings:
    """`python -m dali_pipe pack`."""
    src: str = setting(None, "the dataset, local or s3://bucket/prefix: class subfolders (ImageFolder), a dataset.tsv "
                             "folder, shards, or a Hugging Face dataset (docs/data.md)", positional=True)
    dst: str = setting(None, "where the shards go: a directory or s3://bucket/prefix", positional=True)
    max_side: int = setting(384, "downscale images whose longer side exceeds this many pixels (aspect kept); "
                                 "smaller RGB JPEGs are copied byte for byte", check=AT_LEAST_1)
    quality: int = setting(90, "JPEG quality of re-encoded images",
                           check=(lambda v: 1 <= v <= 100, "must be between 1 and 100"))
    shard_size: int = setting(150_000_000, "target shard size (150MB, 1GiB, or bytes); AWS advises objects of about "
                                           "150 MB for S3 throughput", parse=parse_size,
                              expected="a size such as 150MB or 1GiB", check=AT_LEAST_1)
    pack_workers: int | None = setting(None, "processes that decode and resize (default: the cores available)",
                                       check=AT_LEAST_1, flag="--workers", metavar="N")


@dataclass
class ManifestSettings:
    """`python -m dali_pipe manifest`."""
    folder: str = setting(None, "the ImageFolder: a folder of class subfolders of images (or train/ and val/ of "
                                "them)", positional=True)
    force: bool = setting(False, "replace an existing dataset.tsv")


@dataclass
class EvalSettings:
    """`python -m dali_pipe evaluate`."""
    split: str = setting("val", "which images to evaluate: the validation split (as training made it: the model "
                                "folder records how), the training split, the test files "
                                "of a Hugging Face dataset (test-*) or the shards named test, or all",
                         choices=SPLIT_CHOICES)
    eval_output: str = setting("runs/eval", "output dir: metrics.json, confusion.png, bad_images.tsv",
                               flag="--output", metavar="DIR")


@dataclass
class PredictSettings:
    """`python -m dali_pipe predict`."""
    top_k: int = setting(1, "predictions per image (label, score; then label_2, score_2, ...)", check=AT_LEAST_1)
    predict_output: str = setting("runs/predict", "output dir: predictions.tsv, bad_images.tsv", flag="--output",
                                  metavar="DIR")


GROUPS = {"data": DataSettings, "pipeline": PipelineSettings, "model": ModelSettings, "run": RunSettings,
          "bench": BenchmarkSettings, "sync": SyncSettings, "eval": EvalSettings, "predict": PredictSettings,
          "pack": PackSettings, "manifest": ManifestSettings}


@dataclass
class Settings:
    """All settings of one command, grouped; unused groups keep their defaults."""
    data: DataSettings = field(default_factory=DataSettings)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    run: RunSettings = field(default_factory=RunSettings)
    bench: BenchmarkSettings = field(default_factory=BenchmarkSettings)
    sync: SyncSettings = field(default_factory=SyncSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    predict: PredictSettings = field(default_factory=PredictSettings)
    pack: PackSettings = field(default_factory=PackSettings)
    manifest: ManifestSettings = field(default_factory=ManifestSettings)
    given: frozenset[str] = frozenset()  # the settings the user gave (flags, hyperparameters, keywords), by name


TRAIN_GROUPS = ("data", "pipeline", "model", "run", "bench")
IDENTITY_GROUPS = ("data", "pipeline", "model")  # the groups whose every setting says how it counts (identity=)


def _fields() -> dict[str, tuple[str, dataclasses.Field, object]]:
    """name -> (group, field, resolved type), for every setting; names are unique across groups."""
    out = {}
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.name not in out, f"setting {f.name!r} is defined twice"
            out[f.name] = (group, f, hints[f.name])
    return out


FIELDS = _fields()


def recipe_names(groups=IDENTITY_GROUPS) -> list[str]:
    """The settings of `groups` whose values are part of a run's identity (identity=RECIPE)."""
    return [n for n, (g, f, _) in FIELDS.items() if g in groups and f.metadata["identity"] == RECIPE]


def recipe(values) -> dict:
    """The identity values of one settings object (DataSettings, PipelineSettings, ModelSettings), by name, as
    JSON keeps them (a pair as a list), so that a value read back from a checkpoint or a JSON file compares
    equal to the same value given again."""
    group = next(g for g, cls in GROUPS.items() if isinstance(values, cls))
    return {n: list(v) if isinstance(v, tuple) else v
            for n in recipe_names((group,)) for v in [getattr(values, n)]}


def flag_of(name: str) -> str:
    meta = FIELDS[name][1].metadata
    return meta["flag"] or "--" + name.replace("_", "-")


def converter(name: str):
    """(str -> value, words for 'is not X'), from the field's parse= or its type."""
    _, f, tp = FIELDS[name]
    if f.metadata["parse"]:
        return f.metadata["parse"], f.metadata["expected"]
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    base = args[0]
    if typing.get_origin(base) is tuple:
        base = typing.get_args(base)[0]
    if base is bool:
        return parse_bool, "true or false"
    if base is int:
        return int, "an integer"
    if base is float:
        return float, "a number"
    return str, "a string"


def tolerant(conv, expected: str):
    def parse(s: str):
        try:
            return conv(s)
        except (TypeError, ValueError):
            return Invalid(s, expected)
    parse.__name__ = expected  # argparse names the type in its own messages
    return parse


def selected(groups) -> list[str]:
    """The setting names a command exposes: whole groups by name, and single settings by flag ('--model')."""
    return [n for n, (g, _, _) in FIELDS.items() if g in groups or flag_of(n) in groups]


def settings_from_keywords(values: dict, names) -> Settings:
    """Settings from Python keyword arguments (the library API: `batch_size=8` for `--batch-size 8`),
    for the settings `names`. A string is read as the CLI reads it ("8", "64MB"); any other value that is
    not of the setting's type is kept as Invalid, so that validate() lists it with the other problems in
    the CLI's words. An unknown name is a TypeError naming the closest one."""
    s = Settings(given=frozenset(values))
    names = list(names)
    for name, value in values.items():
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"unexpected keyword argument {name!r}{hint}")
        group, f, tp = FIELDS[name]
        conv, expected = converter(name)
        pair = _pair_length(tp)
        if pair:  # a pair (crop_scale=(0.35, 1.0)); as text, "0.35 1.0" or "0.35, 1.0" as the CLI takes it
            expected = f"{pair} numbers, such as {f.default!r}"
            if isinstance(value, str):
                parts = [tolerant(conv, expected)(v) for v in value.replace(",", " ").split()]
                ok = len(parts) == pair and not any(isinstance(v, Invalid) for v in parts)
                value = tuple(parts) if ok else Invalid(value, expected)
        if isinstance(value, str) and conv is not str:
            value = tolerant(conv, expected)(value)
        elif value is not None and not _of_type(value, tp):
            value = Invalid(repr(value), expected)
        elif isinstance(value, list):
            value = tuple(value)
        setattr(getattr(s, group), name, value)
    return s


def _pair_length(tp) -> int:
    """The length of a setting's tuple type (crop_scale: 2), else 0."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    for a in [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]:
        if typing.get_origin(a) is tuple:
            return len(typing.get_args(a))
    return 0


def _of_type(value, tp) -> bool:
    """Whether a Python value fits a setting's annotation (int for float, a 2-sequence of numbers for a pair)."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
    for a in args:
        if typing.get_origin(a) is tuple:
            if isinstance(value, (tuple, list)) and len(value) == len(typing.get_args(a)) and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                return True
        elif a is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return True
        elif a is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif isinstance(a, type) and isinstance(value, a):
            return True
    return False


def field_problems(s: Settings, names) -> list[str]:
    """Per-field problems: values that did not parse, choices, and each field's checks."""
    problems = []
    for name in names:
        group, f, _ = FIELDS[name]
        value = getattr(getattr(s, group), name)
        flag = flag_of(name) if not f.metadata["positional"] else name
        values = value if isinstance(value, (list, tuple)) else [value]
        bad = [v for v in values if isinstance(v, Invalid)]
        if bad:
            problems += [f"{flag}: {v.value!r} is not {v.expected}" for v in bad]
            continue
        if value is None:
            continue
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):  # every float setting: no inf, nan
            problems.append(f"{flag}: {value!r} is not a finite number")
            continue
        if f.metadata["choices"] and value not in f.metadata["choices"]:
            problems.append(f"{flag}: {value!r} is not one of {', '.join(f.metadata['choices'])}")
            continue
        checks = f.metadata["check"] or []
        for pred, msg in [checks] if isinstance(checks, tuple) else checks:
            if not pred(value):
                problems.append(f"{flag}: {value!r} {msg}")
                break
    return problems


def validate(s: Settings, groups=TRAIN_GROUPS, problems: list[str] = (), data_check=None) -> None:
    """Check every setting of `groups`; raise one UsageError listing every problem (with `problems`
    found earlier, such as unknown flags). `data_check(data)`: what is wrong with --data, from the registry of
    input forms (inputs.data_problem), which sits above the settings."""
    problems = list(problems) + field_problems(s, selected(groups))
    if "bench" in groups and isinstance(s.bench.loaders, str) and "packed" in s.bench.loaders.split(","):
        if not s.bench.packed:
            problems.append("--loaders: 'packed' needs --packed, a pack of --data (python -m dali_pipe pack DATA DIR)")
    if ("model" in groups or "--model" in groups) and isinstance(s.model.model, str) and is_path(s.model.model) \
            and not os.path.lexists(os.path.expanduser(s.model.model)):
        problems.append(f"--model: {s.model.model!r} does not exist; pass the folder a training run wrote (train.py's "
                        "--output: config.json, the weights and preprocessor_config.json), or a hub id such as "
                        f"{DEFAULT_MODEL}")
    if "model" in groups:
        if s.model.model == "none" and not s.bench.benchmark:
            problems.append("--model: 'none' only makes sense with --benchmark (it times the loaders without a model)")
    if "data" in groups and isinstance(s.data.data, str) and data_check is not None:
        problem = data_check(s.data.data)
        if problem:
            problems.append(problem)
    data = s.data.data if isinstance(s.data.data, str) and "://" not in s.data.data else ""
    for group, out in (("run", s.run.output), ("eval", s.eval.eval_output), ("predict", s.predict.predict_output)):
        where = Path(out).resolve() if group in groups and data and os.path.isdir(data) else None
        if where is not None and Path(data).resolve() in (where, *where.parents):  # the files would be read as data
            problems.append(f"--output: {out!r} is {'--data' if where == Path(data).resolve() else 'inside --data'} "
                            f"({data!r}): what the command writes there is read as data by the next run (folders as "
                            "an ImageFolder's classes); pass an --output outside --data, such as runs/NAME")
    if "pipeline" in groups and s.pipeline.device == "gpu" and not _cuda_available():
        problems.append("--device: 'gpu' but no CUDA GPU is visible; use --device cpu (or auto)")
    if problems:
        raise UsageError("invalid arguments:\n  " + "\n  ".join(problems))


def is_path(name: str) -> bool:
    """A --model that can only be a local folder (absolute, or starting with ., .. or ~), never a hub id."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# -- resolution of the defaults that depend on other settings or on the machine ----------------
def default_cache_dir() -> Path:
    """Where S3 data and the scan cache live: $DALI_PIPE_CACHE, else ~/.cache/dali_pipe."""
    return Path(os.environ.get("DALI_PIPE_CACHE", Path.home() / ".cache" / "dali_pipe"))


def resolve_device(device: str) -> str:
    if device == "auto":
        return "gpu" if _cuda_available() else "cpu"
    return device


def resolve_precision(precision: str, device: str) -> str:
    """auto: bf16-mixed where the GPU has native bf16 (sm80+), 16-mixed on older GPUs, 32-true on CPU."""
    if precision != "auto":
        return precision
    if device == "cpu":
        return "32-true"
    import torch

    return "bf16-mixed" if torch.cuda.get_device_capability()[0] >= 8 else "16-mixed"


def resolve(s: Settings, *, machine: bool = True) -> Settings:
    """Fill, once, the defaults that depend on other settings or on the machine (not the data). machine=False
    leaves the device and precision as given: a data command (pack) never reads them, and deciding them
    imports torch (1.6 s)."""
    s = dataclasses.replace(s, data=dataclasses.replace(s.data), pipeline=dataclasses.replace(s.pipeline),
                            model=dataclasses.replace(s.model), run=dataclasses.replace(s.run))
    s.data.cache_dir = str(s.data.cache_dir or default_cache_dir())
    if s.model.model is None:
        s.model.model = TINY if s.data.data is None else DEFAULT_MODEL
    if s.model.lr is None:
        s.model.lr = DEMO_LR if s.model.model in BUILTIN_MODELS else FINETUNE_LR
    if machine:
        s.pipeline.device = resolve_device(s.pipeline.device)
        s.model.precision = resolve_precision(s.model.precision, s.pipeline.device)
    out = Path(s.run.output)
    s.run.log_dir = str(s.run.log_dir or out / "tensorboard")
    s.run.report_dir = str(s.run.report_dir or out)
    s.run.checkpoint_dir = str(s.run.checkpoint_dir or out / "checkpoints")
    return s
