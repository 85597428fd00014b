"""The GPU decoder's rules (dali_pipe/decoder.py): the nvJPEG nvImageCodec loads, which training decode runs on
the GPU with it, and nvImageCodec's refusals counted instead of printed once per image."""
from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

import pytest

from dali_pipe import decoder
from dali_pipe.config import PipelineSettings
from dali_pipe.decoder import DecoderLog, Nvjpeg, find_nvjpeg, training_roi_decode
from dali_pipe.pipeline import Augment, PipelineOptions, build_pipeline, resources_for_rank
from dali_pipe.samples import Files
from dali_pipe.spec import ImageSpec


def _distribution_version() -> tuple[int, int, int] | None:
    """The installed nvidia-nvjpeg* wheel's version (major, minor, patch): the issue's independent reading."""
    for name in ("nvidia-nvjpeg", "nvidia-nvjpeg-cu13", "nvidia-nvjpeg-cu12"):
        try:
            return tuple(int(x) for x in metadata.version(name).split(".")[:3])
        except metadata.PackageNotFoundError:
            continue
    return None


def test_the_nvjpeg_found_is_the_installed_wheels_and_its_rule_is_read_from_the_extension():
    """This environment's nvJPEG (the [cuda120] lock's 12.4 here) is found where nvImageCodec's extension loads
    it, its version from the library itself agrees with the wheel's, and the extension's binary holds the
    ROI + fancy-upsampling refusal the rule is about."""
    found = find_nvjpeg()
    assert found.version == _distribution_version(), found
    assert Path(found.source).name.startswith("libnvjpeg.so."), found
    ext = decoder._nvjpeg_extension()
    assert ext is not None and decoder.ROI_FANCY_REFUSAL in ext.read_bytes()
    assert found.roi_fancy_rule


@pytest.mark.parametrize("version,rule,roi", [
    ((12, 4, 0), True, False), ((13, 1, 0), True, False), ((13, 3, 2), True, False), (None, True, False),
    ((12, 4, 0), False, True), (None, False, True)])
def test_roi_decode_with_fancy_upsampling_only_where_the_extension_has_no_refusal(version, rule, roi):
    """nvImageCodec 0.9 refuses an ROI decode with fancy upsampling on every nvJPEG measured (13.1.0 and 13.3.2
    on an H200, though its message names 13.2): the version does not decide, the extension's refusal does;
    the CPU and an ROI decode without fancy upsampling are never affected."""
    found = Nvjpeg(version, "test", rule)
    assert training_roi_decode("gpu", True, found) is roi
    assert training_roi_decode("gpu", False, found) is True
    assert training_roi_decode("cpu", True, found) is True


def test_ld_library_path_comes_first_then_the_wheel_then_the_distribution(tmp_path):
    """The search follows the extension's dlopen: a libnvjpeg on LD_LIBRARY_PATH wins over the wheel's; the
    extension's own RUNPATH is read from it (a CUDA 13 wheel's cu13/lib); an extension that names a library
    found nowhere falls back to the installed distribution's version."""
    wheel = find_nvjpeg()
    other = tmp_path / "lib"
    other.mkdir()
    (other / Path(wheel.source).name).symlink_to(wheel.source)
    via_env = find_nvjpeg(env={"LD_LIBRARY_PATH": f"/nonexistent:{other}"})
    assert via_env.source == str(other / Path(wheel.source).name) and via_env.version == wheel.version
    cu13 = tmp_path / "site" / "nvidia"  # a CUDA 13 wheel's layout: the extension's RUNPATH names cu13/lib
    (cu13 / "cu13" / "lib").mkdir(parents=True)
    (cu13 / "cu13" / "lib" / Path(wheel.source).name).symlink_to(wheel.source)
    ext13 = cu13 / "nvimgcodec" / "extensions" / "libnvjpeg_ext.so.0"
    ext13.parent.mkdir(parents=True)
    ext13.write_bytes(b"\0$ORIGIN:$ORIGIN/../../cu13/lib:/usr/local/cuda/lib64\0" + Path(wheel.source).name.encode()
                      + b"\0" + decoder.ROI_FANCY_REFUSAL + b"\0")
    via_runpath = find_nvjpeg(extension=ext13, env={})
    assert via_runpath.source == str(cu13 / "cu13" / "lib" / Path(wheel.source).name), via_runpath
    fake = tmp_path / "nvimgcodec" / "extensions" / "libnvjpeg_ext.so.0"
    fake.parent.mkdir(parents=True)
    fake.write_bytes(b"\0libnvjpeg.so.97\0")  # no such library anywhere, and no refusal text
    dist = find_nvjpeg(extension=fake, env={})
    assert dist.version == _distribution_version() and "distribution" in dist.source
    assert not dist.roi_fancy_rule and dist.roi_with_fancy_upsampling


def _gpu_graph(folder: Path, training: bool, **kw):
    """The GPU pipeline's graph, built on the CPU: its decoder and crop operators with their arguments."""
    from dali_pipe.demo import make_photo_dataset

    root = make_photo_dataset(folder / f"photos-{training}", classes=2, per_class=2)
    files = [str(p) for p in sorted(root.rglob("*.jpg"))]
    settings = PipelineSettings(device="gpu", num_threads=1)
    opts = PipelineOptions(batch_size=2, device="gpu", resources=resources_for_rank(settings),
                           augment=Augment.from_settings(settings), device_id=0, **kw)
    pipe = build_pipeline(Files(files, [0] * len(files)), ImageSpec(32, 32, (0.5,) * 3, (0.5,) * 3), opts,
                          training=training)
    pipe._build_graph()
    return {type(op._op).__name__: (op._op.device, op._op._init_args) for op in pipe._ops}


@pytest.mark.parametrize("found", [None, Nvjpeg((12, 4, 0), "test"), Nvjpeg((13, 3, 2), "test"),
                                   Nvjpeg((13, 3, 2), "test", roi_fancy_rule=False)],
                         ids=["this-environment", "12.4", "13.3.2", "no-refusal"])
def test_the_gpu_graphs_decoder_arguments_are_ones_nvimgcodec_decodes_on_the_gpu(monkeypatch, tmp_path, found):
    """For the nvJPEG and extension this environment resolves (None), and for others: the training and
    validation GPU graphs decode with libjpeg's chroma upsampling on nvJPEG ("mixed"), and an ROI decode meets
    fancy upsampling only where the extension does not refuse it (read here independently from the extension's
    bytes); otherwise the training crop is fn.random_resized_crop on the GPU, with the ROI decode's crop
    arguments."""
    if found is not None:
        monkeypatch.setattr(decoder, "_FOUND", found)
    refuses = found.roi_fancy_rule if found else decoder.ROI_FANCY_REFUSAL in decoder._nvjpeg_extension().read_bytes()
    for training in (True, False):
        ops = _gpu_graph(tmp_path, training)
        decoders = {k: v for k, v in ops.items() if k in ("Image", "ImageRandomCrop")}
        assert len(decoders) == 1 and all(dev == "mixed" for dev, _ in decoders.values()), decoders
        (name, (_, args)), = decoders.items()
        assert args["jpeg_fancy_upsampling"] is True
        if name == "ImageRandomCrop":  # the refused combination: only where nvImageCodec runs it on the GPU
            assert not refuses, "an ROI decode with fancy upsampling, which this nvImageCodec sends to the CPU"
        if training and refuses:
            assert name == "Image" and ops["RandomResizedCrop"][0] == "gpu"
            assert ops["RandomResizedCrop"][1]["random_area"] == list(PipelineSettings().crop_scale)
            assert ops["RandomResizedCrop"][1]["antialias"] is True
        if not training:
            assert name == "Image"


def test_an_roi_decode_without_fancy_upsampling_stays_an_roi_decode(monkeypatch, tmp_path):
    """fancy_upsampling off (the probe's timing of DALI's default) keeps the ROI decode on any nvJPEG."""
    monkeypatch.setattr(decoder, "_FOUND", Nvjpeg((12, 4, 0), "test"))
    ops = _gpu_graph(tmp_path, True, fancy_upsampling=False)
    assert "ImageRandomCrop" in ops and ops["ImageRandomCrop"][1]["jpeg_fancy_upsampling"] is False


WARN = "ROI decode with fancy upsampling may produce wrong results on image edge (1 pixel wide) with nvJPEG < 13.2"


def _pieces(decoder_id: str, reason: str) -> list[bytes]:
    """One warning as nvImageCodec's messenger writes it: a write per piece."""
    return [b"\x1b[33m", b"[WARNING] ", b"\x1b[0m", b"[", decoder_id.encode(), b"] ", reason.encode(), b"\n"]


def test_the_decoder_log_counts_refusals_and_passes_everything_else_through(capfd):
    """On file descriptor 2 (where nvImageCodec's C++ logger writes, a write per piece), 40 CUDA-decoder and 3
    hardware-decoder warnings whose pieces run into each other as DALI's threads write them become counts, and
    the reason is shown once; other output, a progress bar's partial `\\r` line included, passes through
    unchanged; stderr is the real one again afterwards."""
    import random

    streams = [_pieces("nvjpeg_cuda_decoder", WARN) for _ in range(40)] + \
        [_pieces("nvjpeg_hw_decoder", WARN) for _ in range(3)]
    error = b"\x1b[0;31m[ERROR] \x1b[0m[nvjpeg2k_ext] Failed to load nvJPEG2000 library or retrieve version.\n"
    rng = random.Random(0)
    with DecoderLog() as log:
        os.write(2, b"before\n")
        while streams:  # the threads' pieces, interleaved
            s = rng.choice(streams)
            os.write(2, s.pop(0))
            if not s:
                streams.remove(s)
        os.write(2, b"progress 50%\r")
        os.write(2, error)
        os.write(2, b"after\n")
    os.write(2, b"restored\n")
    err = capfd.readouterr().err
    assert log.refusals.decoders == {"nvjpeg_cuda_decoder": 40, "nvjpeg_hw_decoder": 3}
    reasons = log.refusals.settled()
    assert max(reasons, key=reasons.get) == WARN and sum(reasons.values()) <= 43, reasons
    assert err.count(WARN) == 1 and "[WARNING]" not in err and "nvjpeg_cuda_decoder" not in err, err
    assert "before\n" in err and "progress 50%\r" in err and "after\n" in err and err.endswith("restored\n")
    assert error.decode() in err  # an error is shown as written
    log.refusals.decoders = {"nvjpeg_cuda_decoder": 40}  # no hardware decoder: one CUDA-decoder warning an image
    lines = log.refusals.lines(64)
    assert lines == [f"the GPU decoder refused 40 of 64 images; they were decoded on the CPU: {WARN}"]
    assert log.refusals.lines(30)[0].startswith("the GPU decoder refused 40 images (30 delivered; the rest were")
    assert log.refusals.to_json()["to_cpu"] == 40


@pytest.mark.parametrize("cuda,hw,images", [(3072, 3072, 3072), (5993, 2997, 2997), (40, 0, 40), (0, 12, 0)])
def test_images_to_the_cpu_are_counted_once_each(cuda, hw, images):
    """The counts the GPU check's H200 gave (a hardware decoder's share: one warning of each per image; none:
    the CUDA decoder twice per image): the images decoded on the CPU are the lesser count where both warned; a
    hardware decoder's refusals alone sent nothing to the CPU (the CUDA decoder took them)."""
    r = decoder.Refusals(decoders={k: v for k, v in (("nvjpeg_cuda_decoder", cuda), ("nvjpeg_hw_decoder", hw)) if v})
    assert r.to_cpu() == images
    assert bool(r.lines(100)) == bool(cuda or hw)


def test_the_decoder_log_keeps_a_busy_writer_moving(capfd):
    """Far more than a pipe holds (4 MB), written while the log is open, all arrives: no writer blocks."""
    chunk = b"x" * 1023 + b"\n"
    with DecoderLog():
        for _ in range(4096):
            os.write(2, chunk)
    assert len(capfd.readouterr().err) == 4096 * 1024


def test_the_warning_text_the_rule_cites_is_the_extensions():
    """The reason the log shows is the extension's own text (a test of the citation, not of the code)."""
    ext = decoder._nvjpeg_extension()
    text = ext.read_bytes()
    assert re.search(rb"with nvJPEG < 13\.2", text)
    assert WARN.encode()[:60] in text


def _run(code: str, timeout: int = 60):
    """`code` in a fresh Python from the project's root; its (rc, stdout, stderr)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       cwd=Path(__file__).resolve().parents[1])
    return r.returncode, r.stdout, r.stderr


def test_a_crash_while_the_log_is_open_still_shows_its_last_words():
    """The filter is a process of its own: what a process wrote to stderr just before it aborted (a CUDA error,
    a segfault's report) still reaches the real stderr."""
    rc, _, err = _run("import os\nfrom dali_pipe.decoder import DecoderLog\nlog = DecoderLog().__enter__()\n"
                      "os.write(2, b'terminate called: CUDA error: last words\\n')\nos.abort()\n")
    assert rc != 0 and "CUDA error: last words" in err, (rc, err)


def test_logs_closed_in_any_order_give_stderr_back_and_lose_nothing():
    """Two logs (two MonitorCallbacks, say) closed in the order they were opened: every line arrives, and fd 2
    is the real stderr again afterwards (it stayed a pipe, and later output was lost)."""
    rc, out, err = _run(
        "import os\nfrom dali_pipe.decoder import DecoderLog\nbefore = os.fstat(2)\n"
        "a = DecoderLog().__enter__(); b = DecoderLog().__enter__()\nos.write(2, b'inside\\n')\n"
        "a.__exit__(None, None, None); os.write(2, b'between\\n'); b.__exit__(None, None, None)\n"
        "print(os.path.samestat(before, os.fstat(2)))\nos.write(2, b'after\\n')\n1 / 0\n")
    assert out.strip() == "True" and rc == 1, (out, err)
    assert err.index("inside") < err.index("between") < err.index("after") < err.index("ZeroDivisionError"), err


def test_a_child_that_outlives_the_log_writes_to_stderr_not_into_a_file():
    """A process started while the log is open and writing after it closed (a DataLoader's persistent worker):
    its line reaches stderr, and no file opened after the close receives it (the closed descriptor's number
    was reused)."""
    code = ("import os, subprocess, time\nfrom dali_pipe.decoder import DecoderLog\nwith DecoderLog():\n"
            "    child = subprocess.Popen(['sh', '-c', 'sleep 1; echo CHILD-LINE >&2'])\n"
            "with open('/dev/null', 'rb'), open('/dev/null', 'rb'):\n    pass\n"
            "import tempfile\nf = tempfile.TemporaryFile()\nf.write(b'WEIGHTS\\n'); f.flush()\nchild.wait()\n"
            "time.sleep(0.5)\nf.seek(0)\nprint(f.read())\n")
    rc, out, err = _run(code)
    assert rc == 0 and "CHILD-LINE" in err and out.strip() == "b'WEIGHTS\\n'", (rc, out, err)


def test_other_programs_lines_pass_through_even_beside_warnings(capfd):
    """Log lines with a level tag, a path naming an extension inside a word, blank lines, and a traceback that
    lands among a warning's pieces once are another program's: they pass through (each, every time); the
    warnings around them are still counted."""
    foreign = [b"[INFO] throughput is being measured\n", b"OSError: libnvjpeg_ext.so.0: cannot open\n",
               b"my_nvjpeg_ext loaded\n", b"\n", b"Traceback (most recent call last):\n"]
    with DecoderLog() as log:
        for i in range(6):
            pieces = _pieces("nvjpeg_cuda_decoder", WARN)
            if i == 0:
                pieces.insert(5, b"Traceback (most recent call last):")  # lands inside a warning's line
            for p in pieces:
                os.write(2, p)
            for line in foreign:
                os.write(2, line)
    err = capfd.readouterr().err
    assert log.refusals.decoders == {"nvjpeg_cuda_decoder": 6}, log.refusals
    for line in foreign[:3]:
        assert err.count(line.decode()) == 6, (line, err)
    assert err.count("Traceback (most recent call last):\n") == 6


def test_a_log_opened_twice_or_closed_twice_is_refused_or_harmless(capfd):
    """Entering one log twice is an error; closing it twice, or closing one never opened, does nothing."""
    log = DecoderLog()
    log.__exit__(None, None, None)
    with log:
        with pytest.raises(RuntimeError, match="open already"):
            log.__enter__()
    log.__exit__(None, None, None)
    os.write(2, b"still stderr\n")
    assert capfd.readouterr().err.endswith("still stderr\n")


def test_ctrl_c_and_sigterm_to_the_process_group_leave_stderr_working():
    """Ctrl-C in a terminal (SIGINT to the whole process group) and a SIGTERM to the group stop the run, not the
    filter: what the run then writes to stderr ("stopped by Ctrl-C", a traceback) still arrives."""
    rc, _, err = _run(
        "import os, signal, time\nfrom dali_pipe.decoder import DecoderLog\nos.setpgid(0, 0)\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)\nlog = DecoderLog().__enter__()\n"
        "try:\n    os.killpg(0, signal.SIGINT); time.sleep(1)\nexcept KeyboardInterrupt:\n"
        "    os.killpg(0, signal.SIGTERM); time.sleep(0.5)\n    os.write(2, b'stopped by Ctrl-C\\n')\n"
        "log.__exit__(None, None, None)\nos.write(2, b'after\\n')\n")
    assert rc == 0 and "stopped by Ctrl-C\nafter\n" in err, (rc, err)
