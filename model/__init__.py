"""The model side: a ViT classifier (transformers) as a LightningModule, and spot-safe checkpoints."""
