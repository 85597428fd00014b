#!/usr/bin/env bash
# Run HERE (no GPU needed) before using the lent GPU machine: stages DALI plus pytest for it
# (../shared/gpu/stage-dali -> .gpu-stage/p1..pN) and exports the source photographs to
# .gpu-photos/ (that machine has no scikit-image). Then make the device calls listed in the
# README's "GPU check" section, back to back.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
../shared/gpu/stage-dali pytest iniconfig pluggy
.venv/bin/python -c "from dali_pipe.demo import export_photos; export_photos('.gpu-photos')"
du -sh .gpu-stage/p* .gpu-photos
