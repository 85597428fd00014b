"""The DALI pipeline on the CPU (everywhere) and the GPU (when present), against a PIL + numpy reference."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import cpu_options

from dali_pipe.config import PipelineSettings
from dali_pipe.decoder import GPU_DECODE_LEVELS
from dali_pipe.pipeline import Augment, PipelineOptions, build_pipeline, resources_for_rank
from dali_pipe.samples import Files
from dali_pipe.spec import ImageSpec

SPEC = ImageSpec(64, 48, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
# Tolerance of the validation output against PIL's bilinear (antialiased) resize, in normalised
# units: DALI and PIL both decode with libjpeg(-turbo) but resample with slightly different filters.
TOL = {  # (mean, p99, max) of |dali - reference| in normalised units
    "cpu": (0.01, 0.06, 0.35),  # measured on the CPU: 0.003, 0.031, 0.25
    # nvJPEG's IDCT and chroma upsampling differ from libjpeg-turbo's; wider bounds, printed by the
    # GPU check (pytest -s) so the measured values can replace these guesses
    "gpu": (0.03, 0.2, 1.0),
}


def _options(batch: int, device: str, threads: int = 1, **augment) -> PipelineOptions:
    settings = PipelineSettings(device=device, num_threads=threads, **augment)
    return PipelineOptions(batch_size=batch, device=device, resources=resources_for_rank(settings),
                           augment=Augment.from_settings(settings), device_id=0 if device == "gpu" else None)


def _files(root, n=None):
    from dali_pipe.manifest import read_manifest

    m = read_manifest(root, val_fraction=0, seed=0, skip_missing=False)
    s = m.train[:n] if n else m.train
    return [x.path for x in s], [x.label for x in s]


def _reference(path: str, spec: ImageSpec) -> np.ndarray:
    from PIL import Image

    im = Image.open(path).convert("RGB").resize((spec.width, spec.height), Image.BILINEAR)
    x = np.asarray(im, dtype=np.float32) / 255.0
    x = (x - np.array(spec.mean, np.float32)) / np.array(spec.std, np.float32)
    return x.transpose(2, 0, 1)


def _run(pipe):
    pipe.build()
    images, labels = pipe.run()
    if hasattr(images, "as_cpu"):
        images, labels = images.as_cpu(), labels.as_cpu()
    return np.stack([np.asarray(t) for t in images]), np.asarray(labels.as_array()).reshape(-1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_validation_matches_pil_reference(photo_root, device):
    """Decode + resize + normalise equals PIL + numpy within the stated mean/p99/max tolerances."""
    files, labels = _files(photo_root, 8)
    opts = _options(8, device)
    out, out_labels = _run(build_pipeline(Files(files, labels), SPEC, opts, training=False))
    ref = np.stack([_reference(f, SPEC) for f in files])
    assert out.shape == (8, 3, 64, 48) and out.dtype == np.float32
    err = np.abs(out - ref)
    measured = (float(err.mean()), float(np.percentile(err, 99)), float(err.max()))
    print(f"{device} pipeline vs PIL reference: mean {measured[0]:.4f}, p99 {measured[1]:.4f}, max {measured[2]:.4f}")
    for name, got, tol in zip(("mean", "p99", "max"), measured, TOL[device]):
        assert got < tol, (name, got, tol)
    assert list(out_labels) == labels


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_training_output_shape_dtype_and_range(photo_root, device):
    """Random crop + flip stay inside the normalised [0,1] pixel range; batches differ per run."""
    files, labels = _files(photo_root)
    opts = _options(16, device, threads=2)
    pipe = build_pipeline(Files(files, labels), SPEC, opts, training=True)
    a, la = _run(pipe)
    second = pipe.run()[0]
    b = np.stack([np.asarray(t) for t in (second.as_cpu() if device == "gpu" else second)])
    assert a.shape == (16, 3, 64, 48) and a.dtype == np.float32
    lo = (0 - np.array(SPEC.mean)) / np.array(SPEC.std)
    hi = (1 - np.array(SPEC.mean)) / np.array(SPEC.std)
    for c in range(3):
        assert a[:, c].min() >= lo[c] - 1e-4 and a[:, c].max() <= hi[c] + 1e-4
    assert set(la) <= set(labels)
    assert not np.allclose(a, b)


def test_training_crop_is_a_crop_of_the_image(tmp_path):
    """On a left-dark/right-bright image, a crop + resize + flip keeps that 2-valued content."""
    from PIL import Image

    x = np.zeros((200, 300, 3), np.uint8)
    x[:, 150:] = 255
    files = []
    for i in range(4):
        p = tmp_path / f"{i}.png"
        Image.fromarray(x).save(p)
        files.append(str(p))
    spec = ImageSpec(32, 32, (0.5,) * 3, (0.5,) * 3)
    out, _ = _run(build_pipeline(Files(files, [0, 1, 0, 1]), spec, cpu_options(4), training=True))
    # every output pixel is black (-1), white (+1) or an interpolated edge; never outside [-1, 1]
    assert out.min() >= -1 - 1e-5 and out.max() <= 1 + 1e-5
    assert ((np.abs(np.abs(out) - 1) < 1e-3).mean()) > 0.8


def test_resize_shorter_then_center_crop(photo_root):
    """Processors with shortest_edge + crop_size get resize-shorter then a center crop."""
    files, labels = _files(photo_root, 4)
    spec = ImageSpec(32, 32, (0.5,) * 3, (0.5,) * 3, resize_shorter=40)
    out, _ = _run(build_pipeline(Files(files, labels), spec, cpu_options(4, training=False), training=False))
    assert out.shape == (4, 3, 32, 32)


def _halves(tmp_path, n=8):
    """n copies of a 300x200 PNG: left half black, right half white."""
    from PIL import Image

    x = np.zeros((200, 300, 3), np.uint8)
    x[:, 150:] = 255
    files = []
    for i in range(n):
        p = tmp_path / f"{i}.png"
        Image.fromarray(x).save(p)
        files.append(str(p))
    return files


def _batch(files, training, **augment):
    spec = ImageSpec(32, 32, (0.5,) * 3, (0.5,) * 3)
    opts = _options(len(files), "cpu", **augment)
    return _run(build_pipeline(Files(files, list(range(len(files)))), spec, opts, training=training))[0]


def test_crop_scale_bounds_the_crop(tmp_path):
    """Full-area crops always show both halves; crops of 1-2% of the area mostly show one."""
    files = _halves(tmp_path, 16)

    def both(out):  # images holding black and white pixels
        return sum(bool((img < -0.9).any() and (img > 0.9).any()) for img in out)

    assert both(_batch(files, True, crop_scale=(1.0, 1.0))) == 16
    assert both(_batch(files, True, crop_scale=(0.01, 0.02))) <= 8


def test_auto_augment_changes_training_pixels_and_never_validation(photo_root):
    """Each policy changes training pixels only, and DALI's notices about the experimental operator names
    auto_aug calls (12 lines per run) are not shown, whatever the filters in force."""
    import warnings

    files, _ = _files(photo_root, 8)
    plain, validation = _batch(files, True), _batch(files, False)  # the same seed: the same batches each time
    for policy in ("rand", "trivial", "auto"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            augmented = _batch(files, True, auto_augment=policy)
        assert not [w for w in caught if "experimental" in str(w.message)], [str(w.message) for w in caught]
        assert not np.allclose(plain, augmented), policy
        np.testing.assert_array_equal(validation, _batch(files, False, auto_augment=policy, random_erase=1.0))


def test_random_erase_fills_a_rectangle_with_the_mean(tmp_path):
    files = _halves(tmp_path, 8)
    erased = _batch(files, True, crop_scale=(1.0, 1.0), random_erase=1.0)
    plain = _batch(files, True, crop_scale=(1.0, 1.0))
    zeros = [(img == 0).all(axis=0).mean() for img in erased]
    assert all(0.01 <= z <= 0.4 for z in zeros), zeros  # 2-33% of the area (resampling blurs the edge)
    assert all((img == 0).all(axis=0).mean() < 0.01 for img in plain)


def test_decoder_hints_are_dali_arguments_with_dali_defaults():
    """--hw-decoder-load and --hybrid-huffman-threshold reach the pipeline's resources, name arguments
    both of DALI's decoders take, and default to DALI's own values (the threshold by leaving it unset)."""
    from nvidia.dali import backend

    from dali_pipe.config import FIELDS

    res = resources_for_rank(PipelineSettings(device="gpu", num_threads=2, hw_decoder_load=0.0,
                                              hybrid_huffman_threshold=0))
    assert (res.hw_decoder_load, res.hybrid_huffman_threshold) == (0.0, 0)
    for op in ("decoders__Image", "decoders__ImageRandomCrop"):
        schema = backend.GetSchema(op)
        assert float(schema.GetArgumentDefaultValueString("hw_decoder_load")) == PipelineSettings().hw_decoder_load
        dali_threshold = schema.GetArgumentDefaultValueString("hybrid_huffman_threshold")
        assert PipelineSettings().hybrid_huffman_threshold is None
        assert f"default DALI's {dali_threshold}" in FIELDS["hybrid_huffman_threshold"][1].metadata["help"]


@pytest.mark.gpu
def test_t4_like_decoding_keeps_the_pixels(photo_root):
    """No hardware decoder, and a hybrid Huffman threshold of 0: the Huffman decoding on the GPU for every JPEG
    nvJPEG's GPU-hybrid back end takes (nvImageCodec asks nvjpegDecoderJpegSupported per image: baseline JPEGs;
    the others stay on the host), as in the GPU check's T4-like run: the same pixels as the PIL reference,
    within the GPU tolerances."""
    files, labels = _files(photo_root, 8)
    opts = _options(8, "gpu", hw_decoder_load=0.0, hybrid_huffman_threshold=0)
    out, _ = _run(build_pipeline(Files(files, labels), SPEC, opts, training=False))
    err = np.abs(out - np.stack([_reference(f, SPEC) for f in files]))
    assert err.mean() < TOL["gpu"][0] and err.max() < TOL["gpu"][2]


def _gpu_options(batch: int, **kw) -> PipelineOptions:
    settings = PipelineSettings(device="gpu", num_threads=1)
    return PipelineOptions(batch_size=batch, device="gpu", resources=resources_for_rank(settings),
                           augment=Augment.from_settings(settings), device_id=0, **kw)


def test_gpu_graphs_decode_with_libjpegs_chroma_upsampling(photo_root):
    """The GPU graphs (built on the CPU): both of nvJPEG's decoders (training's random-crop ROI decode,
    validation's whole-image decode) upsample chroma as libjpeg-turbo does, the CPU decoder's and PIL's way
    (DALI's default leaves it off); the argument is one both decoders of this DALI take, and it stays off the
    CPU decoder, where it means nothing."""
    from nvidia.dali import backend

    for op in ("decoders__Image", "decoders__ImageRandomCrop"):
        assert backend.GetSchema(op).HasArgument("jpeg_fancy_upsampling"), op
    files, labels = _files(photo_root, 4)
    for training in (True, False):
        opts = dataclasses.replace(_gpu_options(4), augment=Augment.from_settings(PipelineSettings(random_erase=0.25)))
        pipe = build_pipeline(Files(files, labels), SPEC, opts, training=training)
        pipe._build_graph()  # the GPU graph, without a GPU
        decoders = [op._op for op in pipe._ops if type(op._op).__name__ in ("Image", "ImageRandomCrop")]
        assert [d.device for d in decoders] == ["mixed"], decoders
        assert decoders[0]._init_args["jpeg_fancy_upsampling"] is True
    cpu = build_pipeline(Files(files, labels), SPEC, _options(4, "cpu"), training=False)
    cpu._build_graph()
    assert not [op for op in cpu._ops if "jpeg_fancy_upsampling" in getattr(op._op, "_init_args", {})]


# GPU decode against PIL + numpy (libjpeg-turbo: islow IDCT, fancy upsampling), in 0-255 levels, within
# decoder.GPU_DECODE_LEVELS (DALI's CPU decoder gives PIL's pixels exactly: measured). Without fancy upsampling
# nvJPEG replicates the chroma of 4:2:0 JPEGs instead of interpolating it, which moves colour edges by tens of
# levels. The GPU check prints the measured values.
DECODE_TOL = GPU_DECODE_LEVELS  # |GPU decode - PIL| in levels


@pytest.mark.gpu
def test_gpu_decode_gives_pils_pixels_and_the_cpu_pipelines(photo_root):
    """nvJPEG as the pipeline runs it (hardware decoder where the GPU has one, and without it) decodes real
    4:2:0 photos to PIL's pixels within DECODE_TOL, and the GPU validation pipeline's output equals the CPU
    pipeline's within the CPU pipeline's own tolerance against PIL; with DALI's default (chroma upsampling
    off) the decode is measurably further from PIL (printed beside)."""
    from nvidia.dali import fn, pipeline_def, types
    from PIL import Image

    from dali_pipe.pipeline import decoder_args

    files, labels = _files(photo_root, 16)
    ref = [np.asarray(Image.open(f).convert("RGB"), dtype=np.int16) for f in files]

    def decode(opts):
        @pipeline_def(batch_size=len(files), num_threads=1, device_id=0)
        def raw():
            data, _ = fn.readers.file(files=files)
            device, hints = decoder_args(opts)
            return fn.decoders.image(data, device=device, output_type=types.RGB, **hints)

        pipe = raw()
        pipe.build()
        (out,) = pipe.run()
        out = out.as_cpu()
        return [np.asarray(out[i], dtype=np.int16) for i in range(len(files))]

    def error(images):
        err = np.concatenate([np.abs(a - b).ravel() for a, b in zip(images, ref)])
        return {"mean": float(err.mean()), "p99": float(np.percentile(err, 99)), "max": float(err.max())}

    measured = {}
    for name, kw in (("hw decoder", {}), ("no hw decoder", {"hw_decoder_load": 0.0})):
        for fancy in (True, False):
            settings = PipelineSettings(device="gpu", num_threads=1, **kw)
            opts = PipelineOptions(batch_size=len(files), device="gpu", resources=resources_for_rank(settings),
                                   augment=Augment.from_settings(settings), device_id=0, fancy_upsampling=fancy)
            measured[name, fancy] = error(decode(opts))
            print(f"GPU decode ({name}, jpeg_fancy_upsampling={fancy}) vs PIL, levels: " +
                  ", ".join(f"{k} {v:.2f}" for k, v in measured[name, fancy].items()))
    for name in ("hw decoder", "no hw decoder"):
        got = measured[name, True]
        assert all(got[k] <= DECODE_TOL[k] for k in DECODE_TOL), (name, got)
        assert got["mean"] < measured[name, False]["mean"], (name, measured)
    cpu = error(decode(_options(len(files), "cpu")))
    print("CPU decode vs PIL, levels: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
    assert cpu["max"] <= 1

    gpu_out, _ = _run(build_pipeline(Files(files, labels), SPEC, _gpu_options(16), training=False))
    cpu_out, _ = _run(build_pipeline(Files(files, labels), SPEC, _options(16, "cpu"), training=False))
    err = np.abs(gpu_out - cpu_out)
    between = (float(err.mean()), float(np.percentile(err, 99)), float(err.max()))
    print("GPU vs CPU validation pipeline, normalised units: mean {:.4f}, p99 {:.4f}, max {:.4f}".format(*between))
    for got, tol in zip(between, TOL["cpu"]):
        assert got < tol, (between, TOL["cpu"])



def test_without_dali_the_library_and_the_cli_name_the_extra_to_install(monkeypatch, capsys):
    """Installed without a DALI extra: the pipeline raises a user error naming both extras, and the CLI prints
    it as one error line (exit 2) wherever DALI is first imported; other missing modules stay tracebacks."""
    import sys

    from dali_pipe.cli import cli
    from dali_pipe.errors import DaliMissingError

    for name in [n for n in sys.modules if n == "nvidia.dali" or n.startswith("nvidia.dali.")]:
        monkeypatch.setitem(sys.modules, name, None)  # what an environment without DALI imports
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    with pytest.raises(DaliMissingError, match=r"\.\[cuda120\]'.*\.\[cuda130\]'"):
        build_pipeline(Files(["a.jpg"], [0]), SPEC, _options(1, "cpu"), training=False)

    def fit():
        from nvidia.dali.plugin.pytorch import DALIGenericIterator  # noqa: F401

    assert cli(fit) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: NVIDIA DALI is not installed") and err.count("\n") == 1

    def other():
        import no_such_module_here  # noqa: F401

    with pytest.raises(ModuleNotFoundError):
        cli(other)


def _subsampled_jpegs(folder) -> dict[str, str]:
    """One real photo (square, so a full-area crop is the whole image) as a JPEG of each chroma layout a camera
    or an encoder writes: 4:2:0, 4:2:2, 4:4:4 and grayscale."""
    from dali_pipe.demo import _photo

    photo = _photo("astronaut").resize((120, 120))
    out = {}
    for name, mode, sub in (("4:2:0", "RGB", 2), ("4:2:2", "RGB", 1), ("4:4:4", "RGB", 0), ("gray", "L", None)):
        path = folder / f"{name.replace(':', '')}.jpg"
        photo.convert(mode).save(path, quality=90, **({} if sub is None else {"subsampling": sub}))
        out[name] = str(path)
    return out


def _train_whole_crop(device: str, files: list[str], roi: bool | None):
    """The training pipeline with a full-area crop (crop_scale 1..1) and nothing else random but the flip."""
    settings = PipelineSettings(device=device, num_threads=1, crop_scale=(1.0, 1.0))
    opts = PipelineOptions(batch_size=len(files), device=device, resources=resources_for_rank(settings),
                           augment=Augment.from_settings(settings), device_id=0 if device == "gpu" else None,
                           roi_decode=roi)
    pipe = build_pipeline(Files(files, list(range(len(files)))), SPEC, opts, training=True)
    out, labels = _run(pipe)
    return out[np.argsort(labels)], pipe.training_decode


def _flip_error(out: np.ndarray, files: list[str]) -> np.ndarray:
    """|output - PIL reference| per sample, against the reference or its mirror image (the random flip)."""
    ref = np.stack([_reference(f, SPEC) for f in files])
    plain, mirrored = np.abs(out - ref), np.abs(out - ref[..., ::-1])
    keep = plain.reshape(len(files), -1).mean(1) <= mirrored.reshape(len(files), -1).mean(1)
    return np.where(keep[:, None, None, None], plain, mirrored)


@pytest.mark.parametrize("roi", [True, False], ids=["roi-decode", "whole-decode-then-crop"])
def test_both_training_decodes_give_the_validation_pixels_for_every_chroma_layout(tmp_path, roi):
    """Both training decodes (the ROI decode, and the whole decode + random_resized_crop that nvJPEG 12 runs on
    the GPU) give, for a full-area crop, PIL's pixels within the CPU tolerance: for 4:2:0, 4:2:2, 4:4:4 and
    grayscale JPEGs alike."""
    jpegs = _subsampled_jpegs(tmp_path)
    files = list(jpegs.values())
    out, decode = _train_whole_crop("cpu", files, roi)
    assert decode == ("roi" if roi else "whole")
    err = _flip_error(out, files)
    for i, name in enumerate(jpegs):
        got = (float(err[i].mean()), float(np.percentile(err[i], 99)), float(err[i].max()))
        assert all(g < t for g, t in zip(got, TOL["cpu"])), (name, got, TOL["cpu"])


@pytest.mark.gpu
def test_gpu_decodes_every_chroma_layout_itself_with_the_cpu_pixels(tmp_path):
    """On the GPU, the training decode the rule picks for this nvJPEG, and the validation decode, are refused by
    none of nvImageCodec's GPU decoders for 4:2:0, 4:2:2, 4:4:4 and grayscale JPEGs (no image goes to the CPU),
    and give PIL's pixels within the GPU tolerance."""
    from dali_pipe.decoder import DecoderLog, nvjpeg

    jpegs = _subsampled_jpegs(tmp_path)
    files = list(jpegs.values())
    with DecoderLog() as log:
        train, decode = _train_whole_crop("gpu", files, None)
        val, _ = _run(build_pipeline(Files(files, list(range(len(files)))), SPEC, _gpu_options(len(files)),
                                     training=False))
    print(f"GPU training decode on {nvjpeg()}: {decode}; nvImageCodec's refusals: {log.refusals.to_json()}")
    assert log.refusals.to_cpu() == 0, log.refusals.lines(2 * len(files))
    for what, err in (("training", _flip_error(train, files)), ("validation", np.abs(val - np.stack(
            [_reference(f, SPEC) for f in files])))):
        for i, name in enumerate(jpegs):
            got = (float(err[i].mean()), float(np.percentile(err[i], 99)), float(err[i].max()))
            print(f"GPU {what} decode of a {name} JPEG vs PIL, normalised units: mean {got[0]:.4f}, "
                  f"p99 {got[1]:.4f}, max {got[2]:.4f}")
            assert all(g < t for g, t in zip(got, TOL["gpu"])), (what, name, got, TOL["gpu"])


def _labels_of(pipe, batches: int) -> list[list[int]]:
    return [np.asarray(pipe.run()[1].as_array()).reshape(-1).tolist() for _ in range(batches)]


def test_a_file_list_reads_as_the_python_list_did_and_their_checkpoints_restore_into_each_other(photo_root, tmp_path,
                                                                                                   monkeypatch):
    """DALI reads the files from a file list (FileList: no Python list of a million paths); a name with spaces
    reads, a name ending in whitespace falls back to `files=` (DALI's list parser would trim it); the stream over
    several epochs is the one `files=` gives, and a checkpoint taken with either restores into the other."""
    import gc
    import os
    import shutil

    import dali_pipe.pipeline as pipeline
    from dali_pipe.pipeline import FileList, file_list

    files, labels = _files(photo_root)
    spaced = tmp_path / "with space" / "a b 7.jpg"  # (not in photo_root: other tests read that whole)
    spaced.parent.mkdir()
    shutil.copy(files[0], spaced)
    files, labels = files + [str(spaced)], labels + [3]
    as_list, as_objects = Files(np.array(files), np.array(labels)), Files(np.array(files, dtype=object), labels)
    opts = dataclasses.replace(_options(8, "cpu"), seed=5)

    def pipe(source, checkpoint=None):
        p = build_pipeline(source, SPEC, opts, training=True, checkpoint=checkpoint)
        p.build()
        return p

    a = pipe(as_list)
    with monkeypatch.context() as m:  # the same files through `files=`, as before file lists
        m.setattr(pipeline, "file_list", lambda *args: None)
        b = pipe(as_objects)
    assert b"/proc/self/fd" in a.serialize() and b"/proc/self/fd" not in b.serialize()  # a list, and files=
    first_a, first_b = _labels_of(a, 9), _labels_of(b, 9)  # 72 samples: over an epoch of 49
    assert first_a == first_b and sorted(sum(first_a, [])[:49]) == sorted(labels)  # each file once an epoch
    ck_a, ck_b = a.checkpoint(), b.checkpoint()
    then = _labels_of(a, 9)
    assert _labels_of(b, 9) == then
    with monkeypatch.context() as m:
        m.setattr(pipeline, "file_list", lambda *args: None)
        from_b = pipe(as_objects, ck_a)
    assert _labels_of(from_b, 9) == then and _labels_of(pipe(as_list, ck_b), 9) == then

    listed = file_list(np.array(files), np.array(labels))
    assert isinstance(listed, FileList) and os.readlink(listed.path).endswith("(deleted)")  # nothing left on disk
    lines = open(listed.path, encoding="utf-8").read().splitlines()
    assert lines[-1] == f"{spaced} 3" and len(lines) == len(files)
    listed.close()
    trailing = tmp_path / "with space" / "ends in a space.jpg "
    shutil.copy(files[0], trailing)
    assert file_list(np.array(files + [str(trailing)]), np.array(labels + [0])) is None
    assert isinstance(file_list(np.array(files, dtype=object), np.array(labels)), FileList)  # (a name not UTF-8 too)
    c = pipe(Files(np.array(files + [str(trailing)]), np.array(labels + [0])))
    seen = sum(_labels_of(c, 7), [])  # 50 files in 7 batches of 8: each file once, the last batch padded
    assert sorted(seen[:50]) == sorted(labels + [0])
    fds = set(os.listdir("/proc/self/fd"))
    del a, c
    gc.collect()
    assert len(set(os.listdir("/proc/self/fd"))) < len(fds)  # the pipelines' lists closed with them


def test_a_name_that_is_not_utf8_is_read_through_the_file_list(photo_root, tmp_path):
    """A file whose name's bytes are not UTF-8 (Python holds it with surrogate escapes, an object column) is read
    through the file list as its bytes: `files=` refused it (DALI: "Unsupported argument type"), so training and
    predict on such a folder stopped with a traceback."""
    import os
    import shutil

    files, labels = _files(photo_root)
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9.jpg")
    shutil.copy(files[0], os.fsencode(odd))
    source = Files(np.array(files[:7] + [odd], dtype=object), np.array(labels[:7] + [2]))
    p = build_pipeline(source, SPEC, dataclasses.replace(_options(8, "cpu"), seed=1), training=False)
    p.build()
    assert sorted(np.asarray(p.run()[1].as_array()).reshape(-1).tolist()) == sorted(labels[:7] + [2])
