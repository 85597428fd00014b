import sys
import pytorch_lightning as pl
from torch import nn, optim

import dali_pipe


class Classifier(pl.LightningModule):
    def __init__(self, num_classes: int):
        super().__init__()
        self.net = nn.Sequential(nn.AdaptiveAvgPool2d(8), nn.Flatten(), nn.Linear(3 * 8 * 8, num_classes))  # yours here

    def training_step(self, batch, batch_idx):  # images (B, 3, H, W) float32, labels (B,) int64, on this device
        loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train_loss" if self.training else "val_loss", loss)
        return loss

    validation_step = training_step  # the same loss, logged as val_loss

    def configure_optimizers(self):
        return optim.AdamW(self.parameters(), lr=1e-2)


data, out, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else -1  # DATA OUT [STEPS]
dm = dali_pipe.DaliDataModule(data=data, model="tiny", batch_size=8)  # or image_size=..., mean=..., std=...
dm.prepare_data()  # sync, scan, report; dm.classes is known from here
trainer = pl.Trainer(max_epochs=3, max_steps=max_steps, default_root_dir=out, log_every_n_steps=5, callbacks=[
    pl.callbacks.ModelCheckpoint(dirpath=f"{out}/checkpoints", save_last=True, every_n_train_steps=2),
    dali_pipe.SpotSafeCheckpoint(), dali_pipe.MonitorCallback()])  # SIGTERM: save, exit 0; where the time goes
trainer.fit(Classifier(len(dm.classes)), datamodule=dm, ckpt_path="last")  # a rerun continues from the last save
