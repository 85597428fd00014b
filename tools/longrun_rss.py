#!/usr/bin/env python3
"""Long-run stability: train N epochs (tiny ViT, DALI CPU pipeline, real Trainer) and report host
RSS at the end of every epoch, and its growth from epoch 2 to the last. Prints one JSON object.

    python tools/longrun_rss.py --data DIR [--epochs 20] [--batch-size 8]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--output", default="runs/longrun")
    args = p.parse_args()

    import psutil
    import pytorch_lightning as pl

    from dali_pipe.config import DataSettings, ModelSettings, PipelineSettings
    from dali_pipe.datamodule import DaliDataModule
    from dali_pipe.spec import ImageSpec
    from model.loading import load_processor
    from model.module import ImageClassifier

    rss = []

    class RSS(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            rss.append(psutil.Process().memory_info().rss / 2**20)

    out = Path(args.output)
    spec = ImageSpec.from_processor(load_processor("tiny"))
    dm = DaliDataModule(DataSettings(data=args.data, batch_size=args.batch_size, cache_dir=str(out / "cache")),
                        PipelineSettings(device="cpu", num_threads=1), spec, out)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[RSS()])
    trainer.fit(ImageClassifier(ModelSettings(model="tiny", lr=1e-3), seed=0), datamodule=dm)
    growth = (rss[-1] - rss[1]) / rss[1]
    print(json.dumps({"epochs": args.epochs, "rss_mb": [round(x, 1) for x in rss],
                      "growth_epoch2_to_last": growth}))


if __name__ == "__main__":
    main()
