"""Write the data configs that timm itself resolves for a few models as a test fixture (run by hand, not by
the suite): tests/timm_configs/configs.json, {model name: {"config": timm.data.resolve_data_config(model=...),
"eval": what timm's evaluation transform for it does (create_transform(**config)): the shorter side it resizes
to, with which interpolation, and the center crop}}.

timm is not a dependency of this project (it needs torchvision, which cannot be imported beside the lock's
torch), so run this in a throwaway venv that has it:

    python3 -m venv /tmp/timm && /tmp/timm/bin/pip install /path/to/torch-2.13.0+cpu-*.whl 'torchvision==0.28.*' \
        timm==1.0.31 && /tmp/timm/bin/python tests/timm_configs/make_fixtures.py

The models are built without weights (pretrained=False: their pretrained_cfg, which the data config comes from,
is part of timm). torchvision's operator registrations are skipped where its compiled ops do not match the
torch build beside it (PyPI's torchvision next to a CPU torch): resolving a data config never calls them.
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

MODELS = [  # bicubic and bilinear, crop_pct 0.875 to 1.0, 224 to 384 pixels, ImageNet's and other statistics
    "vit_base_patch16_224", "deit_small_patch16_224", "convnext_tiny", "resnet50", "resnet18.tv_in1k",
    "efficientnet_b0", "inception_v3", "swin_tiny_patch4_window7_224", "vit_base_patch16_384",
    "mobilenetv3_large_100",
]


def main() -> None:
    try:
        import torchvision  # noqa: F401
    except RuntimeError:  # "operator torchvision::nms does not exist": its compiled ops are for another torch build
        for name in [m for m in sys.modules if m.startswith("torchvision")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
    import timm
    import timm.data

    configs = {}
    for name in MODELS:
        config = timm.data.resolve_data_config({}, model=timm.create_model(name, pretrained=False))
        steps = {type(t).__name__: t for t in timm.data.create_transform(**config, is_training=False).transforms}
        resize, crop = steps["Resize"], steps["CenterCrop"]
        configs[name] = {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
                         "eval": {"resize_shorter": resize.size, "interpolation": resize.interpolation.value,
                                  "crop": list(crop.size)}}
    out = Path(__file__).resolve().parent / "configs.json"
    out.write_text(json.dumps({"timm": timm.__version__, "configs": configs}, indent=1) + "\n")
    print(f"wrote {out}: {len(configs)} configs from timm {timm.__version__}")


if __name__ == "__main__":
    main()
