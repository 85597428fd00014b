"""The GPU JPEG decoder's rules: which decode nvImageCodec runs on the GPU for the nvJPEG this process
loads, and telling when it did not.

DALI's `device="mixed"` decoders hand every image to nvImageCodec, which asks its decoders in turn (the
hardware JPEG decoder, then nvJPEG's CUDA decoder, then libjpeg-turbo on the CPU) and gives the image to the
first that accepts it. A refusal is silent in the pixels and costs the CPU the decode; the only trace is one
`[WARNING] [<decoder>] <reason>` line per image on stderr.

The rule this module encodes (nvImageCodec 0.9's nvJPEG extension, `libnvjpeg_ext.so`: its CUDA and hardware
decoders' `canDecode` refuse a region-of-interest decode with `fancy_upsampling`, with the warning "ROI decode
with fancy upsampling may produce wrong results on image edge (1 pixel wide) with nvJPEG < 13.2 (available in
CTK 13.3)"; DALI passes `jpeg_fancy_upsampling` to both as their `fancy_upsampling` option, and has no argument
for the extension's `enable_roi_fancy_upsampling` override). The message names nvJPEG 13.2, but the extension
refused under nvJPEG 13.3.2 too, measured on an H200 (`Nvjpeg.roi_with_fancy_upsampling`), so wherever the
extension holds that refusal, the GPU training decode is a whole-image decode followed by `fn.random_resized_crop`
on the GPU (`training_roi_decode`): both devices keep libjpeg-turbo's chroma upsampling and the GPU decodes every
JPEG. `find_nvjpeg` says which nvJPEG is loaded, for the reports.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

# The refusal as the extension's binary spells it: where it is absent (an older or newer nvImageCodec), the rule
# is not in force.
ROI_FANCY_REFUSAL = b"ROI decode with fancy upsampling may produce wrong results"
# How far nvJPEG's decode (fancy upsampling on) may be from libjpeg-turbo's (DALI's CPU decoder's, PIL's), in 0-255
# levels. Measured on an H200 (2026-12-04, nvJPEG 13.3.2, 16 real 4:2:0 photos): mean 0.00-0.03, p99 0-1, max 3,
# with and without the hardware decoder (DALI's own test allows 1 level against its CPU decoder on its images).
# The GPU test (tests/test_pipeline.py) and the GPU check's `versions` step (tools/gpu_probe.py) both hold the
# decode to it.
GPU_DECODE_LEVELS = {"mean": 0.5, "p99": 1, "max": 3}
_NVJPEG_DISTRIBUTIONS = ("nvidia-nvjpeg", "nvidia-nvjpeg-cu13", "nvidia-nvjpeg-cu12")


@dataclass(frozen=True)
class Nvjpeg:
    """The nvJPEG that nvImageCodec loads in this environment (`version` None: not found), and whether its
    extension refuses the ROI decode with fancy upsampling (assumed where the extension cannot be read)."""
    version: tuple[int, int, int] | None
    source: str  # where the version came from, for messages: a library path, a distribution, or "not found"
    roi_fancy_rule: bool = True  # the extension holds the ROI + fancy-upsampling refusal (ROI_FANCY_REFUSAL)

    @property
    def roi_with_fancy_upsampling(self) -> bool:
        """True when an ROI decode with fancy upsampling runs on the GPU: only with an nvImageCodec whose nvJPEG
        extension has no such refusal. Its message names nvJPEG 13.2 as the fix, but on the GPU check's H200
        (2026-12-04) nvImageCodec 0.9 refused the ROI decode with fancy upsampling under nvJPEG 13.3.2 (the
        [cuda130] lock's) as under 13.1.0: 2068 of 2560 training images went to the CPU, and the whole decode
        with a GPU crop ran 3.2x faster (1.35x without the hardware decoder). So the version is reported, not
        trusted."""
        return not self.roi_fancy_rule

    @property
    def name(self) -> str:
        """'nvJPEG 12.4.0' (or 'nvJPEG unknown')."""
        return f"nvJPEG {'.'.join(map(str, self.version)) if self.version else 'unknown'}"

    def __str__(self) -> str:
        return f"{self.name} ({self.source})"


def _nvjpeg_extension() -> Path | None:
    """nvImageCodec's nvJPEG extension, where DALI loads it from (the nvidia-nvimgcodec-cu* wheel)."""
    try:
        spec = importlib.util.find_spec("nvidia.nvimgcodec")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(root, "extensions").glob("libnvjpeg_ext.so*"))
        if found:
            return found[0]
    return None


def _library_version(path: str) -> tuple[int, int, int] | None:
    """nvjpegGetProperty(MAJOR, MINOR, PATCH) of the library at `path` (no GPU needed)."""
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    out = []
    for prop in range(3):  # libraryPropertyType: MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
        v = ctypes.c_int()
        if lib.nvjpegGetProperty(prop, ctypes.byref(v)) != 0:
            return None
        out.append(v.value)
    return tuple(out)


def find_nvjpeg(extension: Path | None = None, env: dict | None = None) -> Nvjpeg:
    """The nvJPEG nvImageCodec's extension loads, found the way its dlopen finds it: LD_LIBRARY_PATH, then the
    extension's RUNPATH (read from the binary: the nvidia-nvjpeg* wheel beside nvImageCodec, `nvjpeg/lib` for
    CUDA 12 and `cu13/lib` for CUDA 13, then /usr/local/cuda/lib64), then the system's loader; the library's own
    nvjpegGetProperty says its version. Without a loadable library, the installed nvidia-nvjpeg* distribution's
    version."""
    env = os.environ if env is None else env
    extension = extension or _nvjpeg_extension()
    rule, soname, binary = True, None, b""
    if extension is not None:
        try:
            binary = extension.read_bytes()
        except OSError:
            binary = b""
        rule = ROI_FANCY_REFUSAL in binary if binary else True
        m = re.search(rb"libnvjpeg\.so\.(\d+)", binary)
        soname = f"libnvjpeg.so.{m.group(1).decode()}" if m else None
    if soname is None:  # DALI's own CUDA major: its nvJPEG has the same one
        dali = [d for d in ("nvidia-dali-cuda130", "nvidia-dali-cuda120") if _installed(d)]
        soname = "libnvjpeg.so.13" if dali[:1] == ["nvidia-dali-cuda130"] else "libnvjpeg.so.12"
    dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    if extension is not None:
        # the extension's RUNPATH, as its dynamic string table holds it ($ORIGIN:...:$ORIGIN/../../cu13/lib:...)
        runpath = re.search(rb"(\$ORIGIN[^\x00]*)\x00", binary)
        dirs += [os.path.normpath(d.replace("$ORIGIN", str(extension.parent))) for d in
                 (runpath.group(1).decode(errors="replace").split(":") if runpath else
                  ["$ORIGIN", "$ORIGIN/../../nvjpeg/lib", "$ORIGIN/../../cu13/lib"])]
    dirs.append("/usr/local/cuda/lib64")
    for d in dirs:
        path = Path(d, soname)
        if path.exists():
            version = _library_version(str(path))
            if version:
                return Nvjpeg(version, str(path), rule)
    version = _library_version(soname)  # the system's loader (ld.so.cache)
    if version:
        return Nvjpeg(version, soname, rule)
    for name in _NVJPEG_DISTRIBUTIONS:
        v = _installed(name)
        if v:
            parts = [int(x) for x in re.findall(r"\d+", v)[:3]]
            return Nvjpeg(tuple(parts + [0] * (3 - len(parts))), f"the {name} {v} distribution", rule)
    return Nvjpeg(None, "not found", rule)


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


_FOUND: Nvjpeg | None = None


def nvjpeg() -> Nvjpeg:
    """find_nvjpeg(), once per process."""
    global _FOUND
    if _FOUND is None:
        _FOUND = find_nvjpeg()
    return _FOUND


def training_roi_decode(device: str, fancy_upsampling: bool, found: Nvjpeg | None = None) -> bool:
    """Whether the training decode is a random-crop ROI decode (`decoders.image_random_crop`) rather than a whole
    decode and `fn.random_resized_crop`: always on the CPU (libjpeg-turbo crops as it decodes); on the GPU where
    nvImageCodec decodes that ROI on the GPU with these settings."""
    if device != "gpu" or not fancy_upsampling:
        return True
    return (found or nvjpeg()).roi_with_fancy_upsampling


# -- refusals, counted -----------------------------------------------------------------------------------
# nvImageCodec's default debug messenger (DALI creates it at warning level) writes each warning to std::cerr in
# pieces, one write each: a colour, "[WARNING] ", a colour, "[", the decoder's id, "] ", the reason, "\n". DALI's
# decoder threads write at once, so on the GPU check's H200 the pieces of different images' warnings ran into
# each other (never inside a piece: a pipe write is whole). So a decoder's id is counted wherever it stands, and
# the reasons are what is left of a line once the other pieces are taken out.
_ANSI = re.compile(rb"\x1b\[[0-9;]*m")
_SEVERITY = re.compile(rb"\[(?:WARNING|ERROR|FATAL ERROR|INFO|DEBUG|TRACE)\] ")
_ERROR = re.compile(rb"\[(?:ERROR|FATAL ERROR)\] ")
# the plugin ids of nvImageCodec 0.9's extensions (their binaries' `plugin_id_` strings, opencv_decoder besides)
# and of the extensions themselves (their load messages)
DECODER_IDS = ("nvjpeg_cuda_decoder", "nvjpeg_hw_decoder", "nvjpeg_lossless_decoder", "nvjpeg2k_cuda_decoder",
               "nvjpeg2k_decoder", "nvtiff_cuda_decoder", "libjpeg_turbo_decoder", "libtiff_decoder", "opencv_decoder",
               "nvbmp_decoder", "nvpnm_decoder", "nvjpeg_ext", "nvjpeg2k_ext", "nvtiff_ext", "libjpeg_turbo_ext",
               "libtiff_ext", "opencv_ext", "nvbmp_ext", "nvpnm_ext")
_DECODER_ID = re.compile("|".join(sorted(DECODER_IDS, key=len, reverse=True)).encode())
_PIECES = re.compile(_SEVERITY.pattern + rb"|\[|\] ?|" + _DECODER_ID.pattern)
CPU_BOUND = "nvjpeg_cuda_decoder"  # the last GPU decoder before libjpeg-turbo: what it refuses goes to the CPU
HARDWARE = "nvjpeg_hw_decoder"


@dataclass
class Refusals:
    """nvImageCodec's warnings, counted: per decoder id, and per reason."""
    decoders: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)

    def to_cpu(self) -> int:
        """Images the GPU decoders refused, so the CPU decoded them. nvJPEG's CUDA decoder, the last before the
        CPU, warns for each; but nvImageCodec asked it twice per image where the hardware decoder was there with
        no share of the images (the GPU check's H200, --hw-decoder-load 0: 5993 CUDA-decoder and 2997
        hardware-decoder warnings for about 3000 images; with the hardware decoder's share, 3072 of each for
        3072). The hardware decoder, where it warned too, asks once per image: then the lesser count."""
        cuda, hw = self.decoders.get(CPU_BOUND, 0), self.decoders.get(HARDWARE, 0)
        return min(cuda, hw) if cuda and hw else cuda

    def settled(self) -> dict[str, int]:
        """The reasons, where two written back to back were read as one ("R1R1") counted as their parts."""
        out: dict[str, int] = {}
        for reason in sorted(self.reasons, key=len):
            rest, n = reason, self.reasons[reason]
            for known in sorted(out, key=len, reverse=True):
                if known in rest:
                    out[known] += rest.count(known) * n
                    rest = rest.replace(known, "")
            rest = rest.strip()
            if len(rest) >= 8:
                out[rest] = out.get(rest, 0) + n
        return out

    def lines(self, images: int | None = None) -> list[str]:
        """Plain words: one line for the images the CPU decoded, one for the hardware decoder's refusals."""
        reasons = self.settled()
        why = f": {max(reasons, key=reasons.get)}" if reasons else ""

        def of(n: int) -> str:
            if not images:
                return f"{n} images"
            return f"{n} of {images} images" if n <= images else \
                f"{n} images ({images} delivered; the rest were decoded ahead)"

        out = []
        if self.to_cpu():
            out.append(f"the GPU decoder refused {of(self.to_cpu())}; they were decoded on the CPU{why}")
        if self.decoders.get(HARDWARE):
            out.append(f"the hardware JPEG decoder refused {of(self.decoders[HARDWARE])} (nvJPEG's CUDA decoder "
                       f"took those it accepts){'' if self.to_cpu() else why}")
        other = sum(n for d, n in self.decoders.items() if d not in (CPU_BOUND, HARDWARE))
        if other:
            out.append(f"nvImageCodec warned {other} times more ({', '.join(sorted(set(self.decoders) - {CPU_BOUND, HARDWARE}))})")
        return out

    def to_json(self) -> dict:
        return {"to_cpu": self.to_cpu(), "by_decoder": dict(sorted(self.decoders.items())),
                "reasons": dict(sorted(self.settled().items(), key=lambda kv: -kv[1]))}


class DecoderLog:
    """Fold nvImageCodec's per-image warnings into counts: while open, file descriptor 2 goes through a pipe
    read by a thread, which counts the `[WARNING] [decoder] reason` lines and passes everything else through to
    the real stderr unchanged (a partial line, a progress bar's `\\r` update, as soon as it is read). The
    first warning of each (decoder, reason) is still shown, with a note that the rest are counted.

        with DecoderLog() as log:
            ...  # run the pipeline
        print(log.refusals.lines(images))
    """

    def __init__(self, show_first: bool = True):
        self.refusals = Refusals()
        self.show_first = show_first
        self._shown: set[str] = set()  # the reasons seen (and shown, with show_first)
        self._saved = self._thread = None

    def __enter__(self) -> "DecoderLog":
        sys.stderr.flush()
        read, write = os.pipe()
        self._saved = os.dup(2)
        os.dup2(write, 2)
        os.close(write)
        self._thread = threading.Thread(target=self._pump, args=(read,), name="decoder-log", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self._saved, 2)  # the pipe's last writer closes: the thread reads to its end and stops
        self._thread.join(timeout=10)
        os.close(self._saved)

    def _forward(self, data: bytes) -> None:
        while data:
            try:
                data = data[os.write(self._saved, data):]
            except OSError:
                return

    def _line(self, line: bytes) -> None:
        """A line of nvImageCodec's (it holds a severity, a decoder id, a reason seen before, or nothing but its
        pieces) is counted and kept back; any other passes through."""
        text = _ANSI.sub(b"", line.rstrip(b"\r\n"))  # a colour is a piece of its own: never inside another
        if _ERROR.search(text):  # an error (an extension that failed to load, say) is shown as it is
            self._forward(line)
            return
        ids = [m.decode() for m in _DECODER_ID.findall(text)]
        rest = [f.strip() for f in _PIECES.split(text)]
        reasons = [f.decode(errors="replace") for f in rest if len(f) >= 8]
        ours = ids or _SEVERITY.search(text) or not any(rest) or any(k in r for r in reasons for k in self._shown)
        if not ours:
            self._forward(line)
            return
        for d in ids:
            self.refusals.decoders[d] = self.refusals.decoders.get(d, 0) + 1
        for r in reasons:
            self.refusals.reasons[r] = self.refusals.reasons.get(r, 0) + 1
            new = r
            for shown in sorted(self._shown, key=len, reverse=True):
                new = new.replace(shown, "")
            if len(new.strip()) >= 8:  # each reason once (two run together: their parts)
                self._shown.add(new.strip())
            if self.show_first and len(new.strip()) >= 8:
                self._forward(f"[nvImageCodec] {new.strip()} (this and the GPU decoder's other warnings are "
                              "counted, not shown)\n".encode())

    def _pump(self, fd: int) -> None:
        pending = b""
        try:
            while True:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._line(line + b"\n")
                # a progress bar's in-place updates (up to its last `\r`) go on now; the rest waits for its line
                cut = pending.rfind(b"\r") + 1
                if cut:
                    self._line(pending[:cut])
                    pending = pending[cut:]
            if pending:
                self._line(pending)
        except Exception:  # never block the process's stderr: whatever is left passes through raw
            self._forward(pending)
            while True:
                try:
                    chunk = os.read(fd, 1 << 16)
                except OSError:
                    break
                if not chunk:
                    break
                self._forward(chunk)
        finally:
            os.close(fd)
