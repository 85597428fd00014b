"""Run by test_ddp.py as a script (Lightning's DDP launcher re-runs it for rank 1): 2 CPU processes
(gloo), the DALI CPU pipeline, the real Trainer. Every image is its own class, so the labels a
rank trains on name exactly the samples it saw. Writes OUT/rank{r}.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytorch_lightning as pl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import datamodule, tiny_settings  # noqa: E402

from dali_pipe.spec import ImageSpec  # noqa: E402
from model.module import ImageClassifier  # noqa: E402


class Tracing(ImageClassifier):
    def on_train_epoch_start(self):
        super().on_train_epoch_start()
        self.seen, self.batches = [], 0

    def training_step(self, batch, batch_idx):
        self.seen += batch[1].tolist()
        self.batches += 1
        return super().training_step(batch, batch_idx)

    def on_validation_epoch_start(self):
        self.val_seen = []

    def validation_step(self, batch, batch_idx):
        self.val_seen += batch[1].tolist()
        return super().validation_step(batch, batch_idx)

    def on_train_epoch_end(self):
        super().on_train_epoch_end()
        self.trace.append({"seen": self.seen, "batches": self.batches, "val_seen": self.val_seen,
                           "metrics": self.epoch_metrics[-1]})


def main(data: str, out: str, epochs: int, batch: int) -> None:
    dm = datamodule(data, out, batch_size=batch, cache_dir=Path(out) / "cache",
                    spec=ImageSpec(64, 64, (0.5,) * 3, (0.5,) * 3))
    module = Tracing(tiny_settings())
    module.trace = []
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(
        {"trace": module.trace, "classes": dm.classes, "train_n": len(dm.manifest.train)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
