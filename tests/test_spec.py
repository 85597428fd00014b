"""ImageSpec from transformers image processors."""
from __future__ import annotations

from dali_pipe.spec import ImageSpec


def test_spec_from_vit_processor():
    from model.loading import load_processor

    s = ImageSpec.from_processor(load_processor("vit-b16-random"))
    assert (s.height, s.width, s.mean, s.std) == (224, 224, (0.5,) * 3, (0.5,) * 3)


def test_spec_shortest_edge_with_center_crop():
    from transformers import ViTImageProcessor

    p = ViTImageProcessor(size={"shortest_edge": 256}, do_center_crop=True, crop_size={"height": 224, "width": 224},
                          image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    s = ImageSpec.from_processor(p)
    assert (s.height, s.width, s.resize_shorter) == (224, 224, 256) and s.mean == (0.485, 0.456, 0.406)
