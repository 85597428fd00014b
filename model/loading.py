"""Load any transformers image classifier and its image processor, from a hub id, a local
save_pretrained directory, or a built-in config.

Built-in names (no download):
- `tiny`: a small random-init ViT (64x64 input, 8x8 patches) for CPU demos and tests.
- `vit-b16-random`: ViT-B/16 at 224 with random weights, the reference model's exact shape,
  for benchmarks on machines that cannot download weights.

Everything else goes through `AutoConfig`, `AutoModelForImageClassification` and
`AutoImageProcessor`: ViT, DeiT, ConvNeXt, Swin, ResNet, EfficientNet and the other architectures
transformers can build for image classification. The head is resized to the data's classes
(`ignore_mismatched_sizes`), with a note when the checkpoint's own head is replaced; a checkpoint
that transformers cannot build as an image classifier is refused, never swapped for another model.
"""
from __future__ import annotations

import hashlib
import json
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import dali_pipe.spec
from dali_pipe.config import BUILTIN_MODELS, TINY, VIT_B16_RANDOM, is_path
from dali_pipe.errors import UserError

from .files import damaged_files


class ModelLoadError(UserError):
    """The --model could not be loaded; the message says what to pass instead (`reason`: what is
    wrong, in a few words, without the advice)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


REEXPORT = ("rerun the training command that wrote it (it exports the model again from its checkpoint), or "
            "train again")  # the way out for a damaged model folder


BUILTIN_SIDE = {TINY: 64, VIT_B16_RANDOM: 224}  # the built-in models' input size (square)
BUILTIN_PROCESSOR = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # and their normalisation


def _builtin_config(name: str):
    from transformers import ViTConfig

    if name == TINY:
        return ViTConfig(image_size=BUILTIN_SIDE[TINY], patch_size=8, hidden_size=96, num_hidden_layers=3,
                         num_attention_heads=3, intermediate_size=192)
    return ViTConfig(image_size=BUILTIN_SIDE[name])  # else the defaults: ViT-B/16, as google/vit-base-patch16-224


def load_processor(name: str):
    """The image processor whose size, crop, mean and std the pipelines use."""
    if name in BUILTIN_MODELS:
        side = BUILTIN_SIDE[name]
        try:  # transformers 5 names the torchvision-free processor explicitly
            from transformers import ViTImageProcessorPil as cls
        except ImportError:
            from transformers import ViTImageProcessor as cls
        return cls(size={"height": side, "width": side}, **BUILTIN_PROCESSOR)
    from transformers import AutoImageProcessor

    load_config(name)  # refuses a checkpoint that is no image classifier before anything else
    try:
        return AutoImageProcessor.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ModelLoadError(_fetch_hint(name, e)) from None


# what AutoImageProcessor builds the processor from (transformers 5 reads processor_config.json's "image_processor"
# first, then preprocessor_config.json; config.json names the model type when they do not name the class)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "config.json")


def image_source(name: str) -> str | None:
    """A digest of everything the model's input size is computed from (ImageSpec.from_processor of the
    processor load_processor returns), read without torch or transformers: the built-in's settings, or the
    bytes of the processor's files (PROCESSOR_FILES, of the local folder, or of the hub's as huggingface_hub
    resolves them, from its cache or a fresh download as transformers would), with transformers' version
    and dali_pipe/spec.py's bytes. A checkpoint records it beside its fingerprint: equal digests mean an equal
    input size, so a finished run's rerun is decided before torch loads (cli/finished.py). None where it
    cannot be read (no such model, no network): the caller then loads the processor."""
    try:
        parts = [version("transformers"), hashlib.sha256(Path(dali_pipe.spec.__file__).read_bytes()).hexdigest()]
        if name in BUILTIN_MODELS:
            parts.append(json.dumps({"builtin": name, "side": BUILTIN_SIDE[name], **BUILTIN_PROCESSOR}))
        else:
            for file in PROCESSOR_FILES:
                path = _processor_file(name, file)
                parts.append(f"{file}: " + (hashlib.sha256(path.read_bytes()).hexdigest() if path else "none"))
    except (OSError, PackageNotFoundError):
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _processor_file(name: str, file: str) -> Path | None:
    """`file` of model `name` (a local folder, else a hub id), or None where the model has none; OSError
    where it cannot be known (a hub id that cannot be reached and is not cached)."""
    if Path(name).expanduser().is_dir():
        path = Path(name).expanduser() / file
        return path if path.is_file() else None
    if is_path(name):
        raise OSError(f"no folder {name}")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    try:
        return Path(hf_hub_download(name, file))
    except RemoteEntryNotFoundError:  # the hub has the model, without this file (not: offline and not cached)
        return None
    except Exception as e:  # offline, a gated or missing repo, a bad name: transformers then says which
        raise OSError(str(e)) from None


def load_config(name: str, classes: list[str] | None = None):
    """The model's config (head sized to `classes` when given); refuses non-classifiers."""
    if name in BUILTIN_MODELS:
        cfg = _builtin_config(name)
    else:
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(name)
        except (OSError, ValueError) as e:
            raise ModelLoadError(_fetch_hint(name, e)) from None
        _check_classifier(cfg, name)
    if classes is not None:
        cfg.num_labels = len(classes)
        cfg.id2label = dict(enumerate(classes))
        cfg.label2id = {c: i for i, c in enumerate(classes)}
    return cfg


def _check_classifier(cfg, name: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES as known

    if cfg.model_type not in known:
        raise ModelLoadError(
            f"--model {name!r} is a {cfg.model_type!r} checkpoint, which transformers cannot build as an image "
            f"classifier. Pass an image-classification model ({', '.join(sorted(known)[:12])}, ...), or "
            f"--model {TINY} / {VIT_B16_RANDOM}.")


def load_model(name: str, classes: list[str]):
    """The classifier with its head sized to `classes` and the label maps set."""
    from transformers import AutoModelForImageClassification

    if name in BUILTIN_MODELS:
        return AutoModelForImageClassification.from_config(load_config(name, classes))
    saved = load_config(name)

    damaged = damaged_files(Path(name)) if Path(name).is_dir() else []
    if damaged:
        raise ModelLoadError(f"--model {name}: {'; '.join(damaged)}. The folder cannot be used as it is: {REEXPORT}.")
    if saved.num_labels != len(classes) or [saved.id2label.get(i) for i in range(saved.num_labels)] != classes:
        print(f"--model {name}: its head predicts {saved.num_labels} classes; a new head for your {len(classes)} "
              "classes is trained from scratch (the rest of the weights are kept)", file=sys.stderr)
    try:
        with _quiet_transformers():  # its load report is a table per run; the lines below say what it would
            model, info = AutoModelForImageClassification.from_pretrained(
                name, num_labels=len(classes), id2label=dict(enumerate(classes)),
                label2id={c: i for i, c in enumerate(classes)}, ignore_mismatched_sizes=True, output_loading_info=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(_fetch_hint(name, e)) from None
    except Exception as e:  # safetensors' SafetensorError: a truncated weights file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ModelLoadError(f"--model {name}: its weights cannot be loaded ({first}); {REEXPORT}.") from None
    _say_unloaded(name, info)
    # from_pretrained returns eval mode, and Lightning keeps a module's mode: dropout and batch-norm
    # statistics would be frozen for the whole fine-tune
    return model.train()


def _say_unloaded(name: str, info: dict) -> None:
    """One line each for the weights a fine-tune does not take from the checkpoint, beyond the resized head
    (said above): those the checkpoint lacks (random init) and those it holds but the model has no place for."""
    resized = {k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", [])}
    for keys, what in ((set(info.get("missing_keys", [])) - resized, "are not in the checkpoint and start from "
                        "random values"), (set(info.get("unexpected_keys", [])), "of the checkpoint are not used")):
        if keys:
            print(f"note: --model {name}: {len(keys)} weight(s) {what} ({_first_keys(keys)})", file=sys.stderr)


def _first_keys(keys) -> str:
    """The first four of `keys` in sorted order, then '...' if there are more."""
    return ", ".join(sorted(keys)[:4]) + (", ..." if len(keys) > 4 else "")


def parameter_count(name: str, classes: list[str]) -> int:
    """Parameters of the model, counted on the meta device (no memory, no weights read)."""
    import torch
    from transformers import AutoModelForImageClassification

    with torch.device("meta"):
        model = AutoModelForImageClassification.from_config(load_config(name, classes))
    return sum(p.numel() for p in model.parameters())


def _fetch_hint(name: str, err: Exception) -> str:
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    if not Path(name).exists():  # transformers read it as a hub id: say that no folder has that name either
        first = (f"there is no folder {name!r} here, and as a hub id: {first}" if not is_path(name) else
                 f"the folder {name!r} does not exist")
    return (f"could not load --model {name!r}: {first}\n"
            "  Without access to the Hugging Face hub, download the model elsewhere and pass its "
            "local directory (config.json, weights, preprocessor_config.json), or use "
            f"--model {TINY} for a CPU demo or --model {VIT_B16_RANDOM} for ViT-B/16 with random weights.")


def load_trained(name: str):
    """A trained classifier as saved (its own head and label map), for evaluate and predict. Its
    files must be whole (and match the checksums its export recorded) and its weights must match
    its config.json key for key: transformers only warns about missing weights and fills them in at
    random, which would evaluate and predict with a random model."""
    if name in BUILTIN_MODELS:
        raise ModelLoadError(f"--model {name!r} is a random-init built-in with no classes of its own; pass the folder "
                             "a training run wrote (train.py's --output) or a hub id.")
    load_config(name)
    return load_checked(name, f"--model {name}")


def load_checked(name: str, what: str, *, verify_files: bool = True):
    """`name` (a save_pretrained folder or a hub id) loaded with transformers, refused with a
    ModelLoadError naming the file or the keys when it is damaged (`verify_files`: against the
    checksums its export recorded) or its weights do not fit its config."""
    from transformers import AutoModelForImageClassification

    folder = Path(name)
    if verify_files and folder.is_dir():
        damaged = damaged_files(folder)
        if damaged:
            raise ModelLoadError(f"{what}: {'; '.join(damaged)}. The folder cannot be used as it is: {REEXPORT}.")
    try:
        with _quiet_transformers():
            model, info = AutoModelForImageClassification.from_pretrained(name, output_loading_info=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(_fetch_hint(name, e)) from None
    except Exception as e:  # safetensors' SafetensorError, torch's size mismatches: the files do not fit
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        reason = f"its weights cannot be loaded ({first})"
        raise ModelLoadError(f"{what}: {reason}; {REEXPORT}.", reason) from None
    missing, unexpected = list(info.get("missing_keys", [])), list(info.get("unexpected_keys", []))
    mismatched = [k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", [])]
    parts = [f"{len(v)} {label} key(s) ({_first_keys(v)})"
             for label, v in (("missing", missing), ("unexpected", unexpected), ("mismatched", mismatched)) if v]
    if unexpected and not (missing or mismatched) and not folder.is_dir():
        # a hub checkpoint with extra weights (every weight of the model was loaded): said, not refused
        print(f"note: {what}: {parts[0]} in its weights are not used by its config's model", file=sys.stderr)
    elif parts:
        reason = (f"its weights do not match its config.json (a {model.config.model_type!r} model): "
                  + "; ".join(parts))
        raise ModelLoadError(f"{what}: {reason}. The folder mixes files of different models; pass the folder one "
                             f"training run wrote, or {REEXPORT}.", reason)
    return model


class _quiet_transformers:
    """transformers prints a table of every missing and unexpected key; we raise one error instead."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self._level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()

    def __exit__(self, *exc):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self._level)
