"""The exceptions that mean "the input or the settings are wrong", which the CLIs report as one
clear message (exit status 2) rather than a traceback."""
from __future__ import annotations


def user_errors() -> tuple[type[BaseException], ...]:
    from model.vit import ModelLoadError

    from .datamodule import ScanError
    from .loader import PipelineDecodeError
    from .manifest import ManifestError
    from .sync import SyncError

    return (ManifestError, ScanError, ModelLoadError, SyncError, PipelineDecodeError)
