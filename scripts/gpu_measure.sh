#!/usr/bin/env bash
# One prepared run on a lent GPU machine (no Jupyter there): measure the device's ceilings and
# every chapter given (default: all written chapters) at --preset gpu, saving reference records
# under data/results/<hardware>/. Everything is bundled into $OUT/results.tar.gz (the device tool
# returns at most 8 files) with one log per chapter inside it.
#   usage: bash scripts/gpu_measure.sh [SLUG ...]
#   env: PER_CHAPTER_TIMEOUT (default 150 s), DEVICE (cuda), PRESET (gpu); a dry run on a laptop:
#        DEVICE=cpu PRESET=smoke INFERBOOK_REFERENCE_DIR=/tmp/ref OUT=/tmp/out bash scripts/gpu_measure.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export INFERBOOK_GIT_COMMIT="${INFERBOOK_GIT_COMMIT:-$(cat .git-commit 2>/dev/null || echo unknown)}"
OUT="${OUT:-/tmp/inferbook-out}"; mkdir -p "$OUT" logs
slugs=("$@")
if [ ${#slugs[@]} -eq 0 ]; then
  mapfile -t slugs < <(python3 -c "from inferbook import book; print('\n'.join(c.slug for c in book.built_chapters()))")
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > logs/nvidia-smi.txt 2>&1
DEVICE="${DEVICE:-cuda}"; PRESET="${PRESET:-gpu}"
python3 -m inferbook.cli ceilings --device "$DEVICE" --save-reference 2>&1 | tee logs/ceilings.log
for slug in "${slugs[@]}"; do
  echo "== $slug"
  timeout "${PER_CHAPTER_TIMEOUT:-150}" python3 -m inferbook.cli measure "$slug" --device "$DEVICE" --preset "$PRESET" \
    --save-reference > "logs/$slug.log" 2>&1
  echo "   exit $? ($(tail -n 1 "logs/$slug.log"))"
done
tar czf "$OUT/results.tar.gz" "${INFERBOOK_REFERENCE_DIR:-data/results}" logs
