"""What a transfer may change of its process, and only in our own commands (`own_process`): glibc's malloc keeps
what a transfer frees for its next chunk (`keep_freed_memory`), and the soft open-file limit is raised towards
the hard one (`requests_room`). In a user's own process neither is touched: fewer requests go at once where
the open-file limit is short, and stderr says so.
"""
from __future__ import annotations

import ctypes
import os
import resource
import sys

FILES_SPARE = 128  # open files left for the rest of the process, beside the requests' (requests_room)


MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its sliding mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)


TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc sets beside it when it slides the mmap threshold up


_MALLOC_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                 "MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST")  # glibc's malloc variables; set, even empty, they tune it


_memory_kept: bool | None = None  # keep_freed_memory's answer, once per process


_process_ours = False  # set by own_process(): this process is one of our commands, whose limits an engine may tune


def keep_freed_memory(one_arena: bool = False) -> bool:
    """Have glibc's malloc keep the memory a transfer frees for its next chunk (once per process, by whichever
    caller comes first; True when set). `one_arena`: also one malloc arena for every thread, for a process
    whose threads all move the same bytes (the sync command; called before it starts any thread).

    Every streamed chunk is a fresh 1 MB bytes object (obstore copies the body's frames into a new one per
    chunk, on one of its own threads), freed once it is written, on another. glibc's defaults hand such
    memory back to the kernel almost at once: its sliding mmap threshold rises to about a chunk's size, and
    its trim threshold to twice that, less than the ~8 MB of chunks four shards keep in flight, so freed
    chunks at the heap's top are trimmed and the next ones fault their pages in anew. Fixed at glibc's own
    ceilings (the 32 MB it slides the mmap threshold up to at most, and twice that for the trim threshold),
    the same memory is reused; with one arena, the threads also share one pool of it instead of warming one
    each. Measured on a 952 MB pack (docs/s3-and-packs.md#how-fast): page faults from 63 000-74 000 to 23 000
    (11 500 with one arena; s5cmd 5 800), system time down 16-53%. The cost: up to 64 MB of freed heap per
    malloc arena stays with the process instead of going back to the kernel (a block above 32 MB still goes
    back as it is freed). An engine in a training process (shard streaming) sets the thresholds too; that was
    not measured there. Process-wide, so left alone where the user tunes malloc already (MALLOC_*_ or glibc.malloc
    tunables in the environment) and where the C library is not glibc (musl, macOS)."""
    global _memory_kept
    if _memory_kept is None:
        _memory_kept = False
        tuned = any(k in os.environ for k in _MALLOC_KNOBS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
        if on_glibc() and not tuned:
            mallopt = ctypes.CDLL(None).mallopt  # M_MMAP_THRESHOLD -3, M_TRIM_THRESHOLD -1, M_ARENA_MAX -8 (malloc.h)
            _memory_kept = bool(mallopt(-3, MMAP_THRESHOLD)) and bool(mallopt(-1, TRIM_THRESHOLD))
            if one_arena:
                mallopt(-8, 1)
    return _memory_kept


def own_process() -> None:
    """Called by our commands (cli.as_a_command) alone: engines in this process may tune what is process-wide,
    the malloc thresholds (keep_freed_memory) and the soft open-file limit (requests_room). In a user's own
    process (DaliDataModule in their script) neither is touched: fewer requests go at once where the
    open-file limit is short, and stderr says so."""
    global _process_ours
    _process_ours = True


def tune_for_transfers(one_arena: bool = False) -> None:
    """What an engine does to its process when it starts (and the sync command, with `one_arena`, before any
    thread): in our commands, malloc keeps freed memory; in a user's own process (one that calls our `main()`
    from its own code included), nothing."""
    if _process_ours:
        keep_freed_memory(one_arena)


def on_glibc() -> bool:
    """Whether this process's C library is glibc (whose malloc keep_freed_memory tunes)."""
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):  # Windows has no confstr; macOS and musl refuse the name
        return False


def requests_room(wanted: int) -> int:
    """How many of `wanted` requests in flight the open-file limit has room for (each holds a connection and, as
    its bytes land, a file; FILES_SPARE more are left for the rest of the process). The soft limit is raised
    towards the hard one first in our own commands (own_process), as Go's runtime does for s5cmd (often 1024 soft,
    far more hard); where even the hard limit is short (or, in a user's process, the soft one), fewer requests go at once, and stderr says so once, instead of a sync whose files
    fail by the thousand with EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * wanted + FILES_SPARE
    if _process_ours and soft != resource.RLIM_INFINITY and soft < need:  # (a user's process keeps its limits)
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted
    room = max(1, (soft - FILES_SPARE) // 2)
    if room not in _told:
        _told.add(room)
        print(f"dali_pipe: the open-file limit ({soft}, `ulimit -n`) leaves room for {room} S3 requests in flight, "
              f"not {wanted}; raise it to use more", file=sys.stderr)
    return room


_told: set[int] = set()
