"""`python -m dali_pipe sync s3://bucket/prefix LOCAL_DIR`: fetch a dataset's manifest and files."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dali_pipe", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sync", help="download dataset.tsv and only the files it lists, in parallel, resumably",
                       description="Download s3://bucket/prefix/dataset.tsv and every file it lists into LOCAL_DIR. "
                       "Files already present and unchanged (size + ETag) are skipped; each file is written "
                       "under a temporary name and renamed when complete, so an interrupted sync can simply be "
                       "rerun. Credentials, region and AWS_ENDPOINT_URL come from the standard AWS environment.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("uri", help="s3://bucket/prefix holding dataset.tsv")
    s.add_argument("local_dir", help="target directory (created if needed)")
    s.add_argument("--workers", type=int, default=32, help="parallel downloads (threads sharing one connection pool)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    from .sync import SyncError, sync

    if args.workers < 1:
        p.error(f"--workers: {args.workers} must be at least 1")
    try:
        stats = sync(args.uri, args.local_dir, workers=args.workers, progress=not args.no_progress)
    except SyncError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.no_progress:
        print(stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
