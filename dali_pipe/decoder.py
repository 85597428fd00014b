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
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import uuid
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
_PIECES = re.compile(rb"\[(?:WARNING|ERROR|FATAL ERROR|INFO|DEBUG|TRACE)\] |\[|\] ?")  # a severity, "[", "] "
_ERROR = re.compile(rb"\[(?:ERROR|FATAL ERROR)\] ")
# the plugin ids of nvImageCodec 0.9's extensions (their binaries' `plugin_id_` strings, opencv_decoder besides)
# and of the extensions themselves (their load messages)
DECODER_IDS = ("nvjpeg_cuda_decoder", "nvjpeg_hw_decoder", "nvjpeg_lossless_decoder", "nvjpeg2k_cuda_decoder",
               "nvjpeg2k_decoder", "nvtiff_cuda_decoder", "libjpeg_turbo_decoder", "libtiff_decoder", "opencv_decoder",
               "nvbmp_decoder", "nvpnm_decoder", "nvjpeg_ext", "nvjpeg2k_ext", "nvtiff_ext", "libjpeg_turbo_ext",
               "libtiff_ext", "opencv_ext", "nvbmp_ext", "nvpnm_ext")
_DECODER_ID = re.compile("|".join(sorted(DECODER_IDS, key=len, reverse=True)).encode())
_WORD = re.compile(rb"[a-z0-9_]")
_RUN = re.compile(rb"[a-z0-9_]*$")
CPU_BOUND = "nvjpeg_cuda_decoder"  # the last GPU decoder before libjpeg-turbo: what it refuses goes to the CPU
HARDWARE = "nvjpeg_hw_decoder"
MAX_REASONS = 64  # distinct reasons kept; past them a line is counted by its decoder ids alone


@dataclass
class Refusals:
    """nvImageCodec's warnings, counted: per decoder id, and per reason."""
    decoders: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)

    def to_cpu(self) -> int:
        """About how many images the GPU decoders refused, so that the CPU decoded them. nvJPEG's CUDA decoder,
        the last before the CPU, warns for each, but nvImageCodec asked it twice per image where the hardware
        decoder was there with no share of the images (the GPU check's H200, --hw-decoder-load 0: 5993
        CUDA-decoder and 2997 hardware-decoder warnings for about 3000 images; with the hardware decoder's
        share, 3072 of each for 3072). So: the CUDA decoder's count, but where the hardware decoder warned too,
        no more than the larger of its count and half the CUDA decoder's."""
        cuda, hw = self.decoders.get(CPU_BOUND, 0), self.decoders.get(HARDWARE, 0)
        return min(cuda, max(hw, (cuda + 1) // 2)) if hw else cuda

    def settled(self) -> dict[str, int]:
        """The reasons, where two written back to back were read as one ("R1R1") counted as their parts."""
        out: dict[str, int] = {}
        for reason in sorted(self.reasons, key=len):
            rest, parts = reason, {}
            for known in sorted(out, key=len, reverse=True):
                if known in rest:
                    parts[known] = rest.count(known)
                    rest = rest.replace(known, "")
            if parts and not rest.strip():  # wholly made of known ones
                for known, n in parts.items():
                    out[known] += n * self.reasons[reason]
            else:
                out[reason] = out.get(reason, 0) + self.reasons[reason]
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
        others = sorted(set(self.decoders) - {CPU_BOUND, HARDWARE})
        if others:
            out.append(f"nvImageCodec warned {sum(self.decoders[d] for d in others)} times more ({', '.join(others)})")
        return out

    def to_json(self) -> dict:
        return {"to_cpu": self.to_cpu(), "by_decoder": dict(sorted(self.decoders.items())),
                "reasons": dict(sorted(self.settled().items(), key=lambda kv: -kv[1]))}

    def minus(self, earlier: "Refusals") -> "Refusals":
        return Refusals({k: n - earlier.decoders.get(k, 0) for k, n in self.decoders.items()
                         if n > earlier.decoders.get(k, 0)},
                        {k: n - earlier.reasons.get(k, 0) for k, n in self.reasons.items()
                         if n > earlier.reasons.get(k, 0)})


class _Filter:
    """The filter's reading of stderr, line by line: nvImageCodec's lines counted and kept back, every other
    line passed on as it came. A line is nvImageCodec's when it holds one of its decoder ids standing as a piece
    (not inside another word: `my_nvjpeg_ext`, `libnvjpeg_ext.so`), nothing but its pieces (a severity, `[`,
    `] `, colours), or a reason already seen beside an id."""

    def __init__(self, forward, show_first: bool = True):
        self.forward, self.show_first = forward, show_first
        self.refusals = Refusals()
        self.shown: set[str] = set()  # the reasons seen beside a decoder id (twice)
        self._beside: dict[str, int] = {}

    def _ids(self, text: bytes) -> list[tuple[int, int, str]]:
        found = []
        for m in _DECODER_ID.finditer(text):
            before, after = text[:m.start()], text[m.end():m.end() + 1]
            run = _RUN.search(before).group(0)  # the word characters the id follows directly
            glued_before = re.search(rb"[a-z_]", run) and not (
                before.endswith(tuple(d.encode() for d in DECODER_IDS))
                or any(before.endswith(r.encode()) for r in self.shown))
            glued_after = after and _WORD.match(after) and not _DECODER_ID.match(text, m.end())
            if glued_before or glued_after:  # inside a word: `libnvjpeg_ext.so`, `my_..._ext`, `..._ext_utils`
                continue
            found.append((m.start(), m.end(), m.group(0).decode()))
        return found

    def line(self, line: bytes) -> None:
        raw = line.rstrip(b"\r\n")
        text = _ANSI.sub(b"", raw)  # a colour is a piece of its own: never inside another
        if (not text.strip() and text == raw) or _ERROR.search(text):  # a blank line, an error: shown as written
            self.forward(line)
            return
        ids = self._ids(text)
        cut, last = [], 0
        for start, end, _ in ids:
            cut.append(text[last:start])
            last = end
        cut.append(text[last:])
        fragments = [f.strip() for piece in cut for f in _PIECES.split(piece)]
        words = [f.decode(errors="replace") for f in fragments if f]
        known = [r for r in self.shown if any(r in w for w in words)]
        if not (ids or not words or known):
            self.forward(line)
            return
        for _, _, d in ids:
            self.refusals.decoders[d] = self.refusals.decoders.get(d, 0) + 1
        for w in words:
            if len(w) < 8:
                continue
            if w in self.refusals.reasons or (ids and len(self.refusals.reasons) < MAX_REASONS):
                self.refusals.reasons[w] = self.refusals.reasons.get(w, 0) + 1
            new = w
            for r in sorted(self.shown, key=len, reverse=True):
                new = new.replace(r, "")
            new = new.strip()
            if not ids or len(new) < 8 or len(self.shown) >= MAX_REASONS or (
                    new not in self._beside and len(self._beside) >= 4 * MAX_REASONS):
                continue
            # a reason is taken as nvImageCodec's once seen beside a decoder id twice (a line of another program's
            # that landed once among a warning's pieces is not)
            self._beside[new] = self._beside.get(new, 0) + 1
            if self._beside[new] == 2:
                self.shown.add(new)
                if self.show_first:
                    self.forward(f"[nvImageCodec] {new.strip()} (this and the GPU decoder's other warnings are "
                                 "counted, not shown)\n".encode())


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _filter_main(marker: bytes) -> None:
    """The filter process: stdin is the pipe the parent's fd 2 writes to, fd 2 the real stderr, stdout the
    answers. Each `marker` read is a question: the counts so far, as one JSON line on stdout. It runs until the
    pipe's last writer closes it (the parent, or a child that outlives it, or a parent that crashed: what they
    wrote still reaches the real stderr)."""

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # it ends with the pipe, after its writers
        signal.signal(sig, signal.SIG_IGN)

    def forward(data: bytes) -> None:
        try:
            _write_all(2, data)
        except OSError:
            pass

    f = _Filter(forward)
    pending = bytearray()
    idle = 0.05  # a partial line waits this long for its end, then goes on (a prompt, a progress bar)
    while True:
        if pending and not select.select([0], [], [], idle)[0]:
            if not pending.startswith((b"[", b"\x1b")):
                forward(bytes(pending))
                pending.clear()
            continue
        try:
            chunk = os.read(0, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        start = max(0, len(pending) - len(marker))
        pending += chunk
        while True:
            at = pending.find(marker, start)
            head = pending if at < 0 else pending[:at]
            cut = head.rfind(b"\n") + 1  # complete lines, up to the marker (or all read)
            if cut:
                for ln in bytes(head[:cut]).split(b"\n")[:-1]:
                    try:
                        f.line(ln + b"\n")
                    except Exception:  # never lose a line to the filter's own fault
                        forward(ln + b"\n")
                del pending[:cut]
                at = -1 if at < 0 else at - cut
            if at < 0:
                break
            del pending[at:at + len(marker)]
            start = at
            r = f.refusals
            _write_all(1, (json.dumps({"decoders": r.decoders, "reasons": r.reasons}) + "\n").encode())
        cr = pending.rfind(b"\r") + 1  # a progress bar's in-place updates go on at once
        if cr and not pending.startswith((b"[", b"\x1b")) and marker[:2] not in pending[:cr]:
            forward(bytes(pending[:cr]))
            del pending[:cr]
        if len(pending) > 1 << 16:  # a line this long is no warning
            forward(bytes(pending))
            pending.clear()
    if pending:
        try:
            f.line(bytes(pending))
        except Exception:
            forward(bytes(pending))


class _Tap:
    """One per process: fd 2 through a pipe to the filter process. DecoderLogs share it (nested, or closed in
    any order), the last one out gives fd 2 back."""

    def __init__(self):
        self.pid = os.getpid()
        self.marker = b"\x00\x00DALI-PIPE-DECODER-LOG-" + uuid.uuid4().hex.encode() + b"\x00\x00"
        sys.stderr.flush()
        read, self._w = os.pipe()
        self._answers, answers_w = os.pipe()
        self._saved = os.dup(2)
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", str(Path(__file__).resolve()), "--filter",
                                          self.marker.hex()], stdin=read, stdout=answers_w, stderr=self._saved,
                                         close_fds=True, start_new_session=True)  # no Ctrl-C of the terminal's
        except BaseException:
            for fd in (self._w, self._answers, self._saved):
                os.close(fd)
            raise
        finally:
            os.close(read)
            os.close(answers_w)
        os.dup2(self._w, 2)
        self.users = 0

    def counts(self, timeout: float = 30.0) -> Refusals:
        """The filter's counts of all it has read up to now (a question through the pipe, its answer back)."""

        try:
            _write_all(self._w, self.marker)
            answer = b""
            while not answer.endswith(b"\n"):
                if not select.select([self._answers], [], [], timeout)[0]:
                    return Refusals()
                chunk = os.read(self._answers, 1 << 16)
                if not chunk:
                    return Refusals()
                answer += chunk
            data = json.loads(answer.splitlines()[-1])
            return Refusals(dict(data["decoders"]), dict(data["reasons"]))
        except (OSError, ValueError):
            return Refusals()

    def close(self) -> None:
        """fd 2 back where it was, if it is still this tap's pipe (else someone redirected it since: theirs)."""
        try:
            sys.stderr.flush()
        except Exception:
            pass
        try:
            try:
                ours = os.path.samestat(os.fstat(2), os.fstat(self._w))
            except OSError:
                ours = False
            if ours:
                os.dup2(self._saved, 2)
        finally:
            for fd in (self._w, self._saved, self._answers):
                try:
                    os.close(fd)
                except OSError:
                    pass
            _CHILDREN.append(self.proc)  # it ends when the pipe's last writer closes; reaped later


_TAP: _Tap | None = None
_TAP_LOCK = threading.Lock()
_CHILDREN: list = []


class DecoderLog:
    """Fold nvImageCodec's per-image warnings into counts: while open, file descriptor 2 goes through a pipe to a
    small filter process, which counts nvImageCodec's lines (`[WARNING] [decoder] reason`, in pieces that
    DALI's threads interleave) and passes every other line on to the real stderr as it came (a partial line
    after 50 ms without more). Each reason is shown once. A process, not a thread: it needs no lock of this
    process to drain the pipe, and whatever is written before a crash, or by a child that outlives the log,
    still reaches the terminal. Logs may nest and close in any order; `refusals` is what arrived while this one
    was open.

        with DecoderLog() as log:
            ...  # run the pipeline
        print(log.refusals.lines(images))

    While open, stderr is a pipe (isatty(2) is False), and its lines may reach the terminal after stdout's."""

    def __init__(self):
        self.refusals = Refusals()
        self._start: Refusals | None = None

    def __enter__(self) -> "DecoderLog":
        global _TAP
        with _TAP_LOCK:
            if self._start is not None:
                raise RuntimeError("this DecoderLog is open already")
            if _TAP is None or _TAP.pid != os.getpid():
                try:
                    _TAP = _Tap()
                except (OSError, ValueError, subprocess.SubprocessError):  # no filter process: nothing counted,
                    _TAP = None  # and stderr stays as it is
                    self._start = Refusals()
                    return self
            _TAP.users += 1
            self._start = _TAP.counts()
        return self

    def __exit__(self, *exc) -> None:
        global _TAP
        with _TAP_LOCK:
            if self._start is None or _TAP is None:
                self._start = None
                return
            try:
                self.refusals = _TAP.counts().minus(self._start)
            finally:
                self._start = None
                _TAP.users -= 1
                if _TAP.users == 0:
                    tap, _TAP = _TAP, None
                    tap.close()
        for proc in list(_CHILDREN):
            if proc.poll() is not None:
                _CHILDREN.remove(proc)


if __name__ == "__main__" and sys.argv[1:2] == ["--filter"]:
    _filter_main(bytes.fromhex(sys.argv[2]))
