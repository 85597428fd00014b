"""Build the ViT and its image processor from a hub id, a local path, or a built-in config.

Built-in names (no download):
- `tiny`: a small random-init ViT (64x64 input, 8x8 patches) for CPU demos and tests.
- `vit-b16-random`: ViT-B/16 at 224 with random weights, the reference model's exact shape,
  for benchmarks on machines that cannot download weights.
"""
from __future__ import annotations

from dali_pipe.config import BUILTIN_MODELS as BUILTIN
from dali_pipe.config import TINY, VIT_B16_RANDOM
from dali_pipe.errors import UserError


class ModelLoadError(UserError):
    """The --model could not be loaded; the message says what to pass instead."""


def _builtin_config(name: str):
    from transformers import ViTConfig

    if name == TINY:
        return ViTConfig(image_size=64, patch_size=8, hidden_size=96, num_hidden_layers=3,
                         num_attention_heads=3, intermediate_size=192)
    return ViTConfig()  # the defaults are ViT-B/16 at 224, as google/vit-base-patch16-224


def _vit_processor_class():
    try:  # transformers 5 names the torchvision-free processor explicitly
        from transformers import ViTImageProcessorPil as cls
    except ImportError:
        from transformers import ViTImageProcessor as cls
    return cls


def load_processor(name: str):
    """The image processor whose size/mean/std the pipelines use."""
    if name in BUILTIN:
        side = _builtin_config(name).image_size
        return _vit_processor_class()(size={"height": side, "width": side},
                                      image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ModelLoadError(_fetch_hint(name, e)) from None


def load_model(name: str, classes: list[str]):
    """ViTForImageClassification with its head sized to `classes` and the label maps set."""
    from transformers import ViTForImageClassification

    id2label = dict(enumerate(classes))
    label2id = {c: i for i, c in id2label.items()}
    if name in BUILTIN:
        cfg = _builtin_config(name)
        cfg.num_labels, cfg.id2label, cfg.label2id = len(classes), id2label, label2id
        return ViTForImageClassification(cfg)
    try:
        return ViTForImageClassification.from_pretrained(
            name, num_labels=len(classes), id2label=id2label, label2id=label2id,
            ignore_mismatched_sizes=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(_fetch_hint(name, e)) from None


def _fetch_hint(name: str, err: Exception) -> str:
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    return (f"could not load --model {name!r}: {first}\n"
            "  Without access to the Hugging Face hub, download the model elsewhere and pass its "
            "local directory (config.json, weights, preprocessor_config.json), or use "
            f"--model {TINY} for a CPU demo or --model {VIT_B16_RANDOM} for ViT-B/16 with random weights.")
