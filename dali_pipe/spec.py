"""What the model expects of an image: size, crop and normalisation, taken from its processor.

Every loader (DALI, the classic baseline, synthetic) is built from one ImageSpec, so the three
always feed the model the same thing. The numbers come from the model's own image processor
config; nothing here assumes ImageNet statistics.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageSpec:
    height: int  # model input height after all resizing/cropping
    width: int  # model input width
    mean: tuple[float, float, float]  # per-channel mean on the [0, 1] scale
    std: tuple[float, float, float]  # per-channel std on the [0, 1] scale
    resize_shorter: int | None = None  # validation: resize the shorter side to this, then center crop;
    #                                   None means resize straight to height x width (ViT)
    interp: str = "linear"  # the processor's resampling filter: nearest, linear, cubic or lanczos

    @classmethod
    def from_processor(cls, processor) -> "ImageSpec":
        """Read size/crop/mean/std from a transformers image processor (ViTImageProcessor & co)."""
        size = _as_dict(processor.size)
        mean = tuple(float(m) for m in processor.image_mean)
        std = tuple(float(s) for s in processor.image_std)
        if len(mean) == 1:
            mean, std = mean * 3, std * 3
        if getattr(processor, "do_rescale", True) is False:
            raise ValueError(f"{type(processor).__name__} has do_rescale=False; the pipelines feed "
                             "[0, 1]-scaled pixels, so use a processor that rescales by 1/255.")
        crop = _as_dict(getattr(processor, "crop_size", None)) if getattr(processor, "do_center_crop", False) else None
        interp = _INTERP.get(int(getattr(processor, "resample", 2) or 2), "linear")
        if "height" in size and "width" in size:
            if crop:
                return cls(int(crop["height"]), int(crop["width"]), mean, std,
                           resize_shorter=min(int(size["height"]), int(size["width"])), interp=interp)
            return cls(int(size["height"]), int(size["width"]), mean, std, interp=interp)
        if "shortest_edge" in size:
            edge = int(size["shortest_edge"])
            if crop:
                return cls(int(crop["height"]), int(crop["width"]), mean, std, resize_shorter=edge, interp=interp)
            crop_pct = getattr(processor, "crop_pct", None)
            if crop_pct:  # ConvNeXt's rule: below 384, resize the shorter side to edge/crop_pct and center-crop
                if edge < 384:
                    return cls(edge, edge, mean, std, resize_shorter=int(edge / crop_pct), interp=interp)
                return cls(edge, edge, mean, std, interp=interp)  # at 384 and above: warp, no crop
            return cls(edge, edge, mean, std, resize_shorter=edge, interp=interp)
        raise ValueError(f"unsupported image processor size {size!r}; expected height/width or shortest_edge.")


_INTERP = {0: "nearest", 1: "lanczos", 2: "linear", 3: "cubic"}  # PIL's resample codes


def _as_dict(size) -> dict:
    """transformers 4 keeps sizes as dicts, 5 as SizeDict objects with None for unset keys."""
    if size is None:
        return {}
    if isinstance(size, int):
        return {"height": size, "width": size}
    keys = ("height", "width", "shortest_edge", "longest_edge")
    get = size.get if isinstance(size, dict) else (lambda k: getattr(size, k, None))
    return {k: get(k) for k in keys if get(k) is not None}
