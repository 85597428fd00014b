"""Shared by evaluate and predict: load the trained model and run a DALI loader through it."""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from model.files import read_record

from ..config import Settings, resolve
from ..errors import UserError
from ..stop import check
from .noise import quiet_known_noise


def check_output(command: str, output: str, model: str | None) -> None:
    """--output may not be the model's own folder: evaluate's metrics.json and bad_images.tsv (predict's
    bad_images.tsv) would replace training's there, the run's record, checksums and split among them, after which
    evaluate silently used another split. A folder inside it is fine."""
    if model and "://" not in model and Path(model).is_dir() and Path(output).resolve() == Path(model).resolve():
        raise UserError(f"{command}: --output {output} is the model's folder (--model {model}), whose metrics.json "
                        f"and bad_images.tsv are training's records; pass another --output, such as "
                        f"{Path(model) / command}")
    if read_record(Path(output)) is not None:  # another trained model's folder
        raise UserError(f"{command}: --output {output} holds a trained model (its metrics.json is training's "
                        f"record); pass another --output, such as {Path(output) / command}")


def prepared(s: Settings, output: str) -> Settings:
    """Resolved settings for an inference command (commands.py checked that --model is given)."""
    quiet_known_noise()  # transformers' "Loading weights" bar, among others
    s.run.output = output
    return resolve(s)


def run_model(model, loader, device: str, precision: str, got: list | None = None):
    """(logits (N, C) float32 on the CPU, labels (N,)) over the loader, in eval mode, no gradients. `got`: a list
    that receives each batch's (logits, labels) as it comes (what was done when the loader fails)."""
    import torch

    dev = torch.device("cuda", 0) if device == "gpu" else torch.device("cpu")
    model.to(dev).eval()
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    autocast = torch.autocast(dev.type, dtype=dtype) if dtype else nullcontext()
    got = [] if got is None else got
    with torch.no_grad(), autocast:
        for images, y in loader:  # images (B,3,H,W) float on the loader's device; y (B,) int64
            check()  # SIGTERM, Ctrl-C: nothing is written (stop.py)
            got.append((model(pixel_values=images.to(dev, non_blocking=True)).logits.float().cpu(), y.cpu()))
    return torch.cat([x for x, _ in got]), torch.cat([y for _, y in got])
