#!/usr/bin/env python3
"""Train an image classifier from a dataset.tsv of JPEGs (local or S3) with a DALI pipeline.

    python train.py                                   # demo: tiny ViT on generated photos, CPU ok
    python train.py --data DIR --model tiny --epochs 2 --device cpu --output OUT
    python train.py --data s3://bucket/prefix --model google/vit-base-patch16-224
    python train.py --benchmark --data DIR --model none --output OUT
    python train.py train                             # SageMaker container contract (/opt/ml)

A thin entry: the commands live in dali_pipe/cli/, every flag in dali_pipe/config.py. The CLI is
also a library: tests call `main([...])`.
"""
import gc
import sys

if __name__ == "__main__":
    gc.disable()  # while the modules load; as_a_command() freezes what they made, then turns the collector on

try:
    from dali_pipe.cli import UsageError, as_a_command, cli, main  # noqa: F401  (UsageError: what main() raises)
except KeyboardInterrupt:  # Ctrl-C before the CLI's handlers are in place: its words and status, no traceback
    if __name__ != "__main__":
        raise
    print("stopped by Ctrl-C", file=sys.stderr)
    sys.exit(130)
except BaseException:  # a process that outlives a failed import here (python -i, pdb, runpy) keeps its collector
    if __name__ == "__main__":
        gc.enable()
    raise

if __name__ == "__main__":
    as_a_command()
    sys.exit(cli())
