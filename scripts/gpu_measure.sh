#!/usr/bin/env bash
# One prepared run on a lent GPU machine (no Jupyter there): measure the device's ceilings, then every
# chapter given (default: all chapters of the book) with `inferbook measure --preset gpu`, saving
# reference records under data/results/<hardware>/. All of it fits in TOTAL_S (720 s at the gpu preset):
# each chapter measures within its time budget (`inferbook budgets` prints the table from
# inferbook.presets.BUDGETS_S) and is stopped at budget + start-up allowance, never past the total.
# Records are saved as each measurement arrives, so a chapter stopped at its timeout keeps what it had
# measured in <chapter>.partial.json ("complete": false), beside the last complete <chapter>.json, which
# only a run that completes replaces. Everything is bundled into $OUT/results.tar.gz
# (the device tool returns at most 8 files) with one log per chapter and logs/summary.tsv inside it.
#
# The commit travels in the environment: the device tool copies the working tree without .git, so the
# caller puts this checkout's commit into the command line. The exact invocation, from the checkout:
#
#   INFERBOOK_GIT_COMMIT=$(git rev-parse HEAD) INFERBOOK_GIT_DIRTY=$(git diff --quiet HEAD && echo 0 || echo 1) bash scripts/gpu_measure.sh
#
# and through the device tool, where `$(...)` would run on the device (no git there), paste the values;
# one device command may run 600 s at most, so the run is two calls of about 6 minutes:
#   run(command="INFERBOOK_GIT_COMMIT=<40-hex from git rev-parse HEAD> INFERBOOK_GIT_DIRTY=<0|1> PART=1/2 bash scripts/gpu_measure.sh", timeout_s=600)
#   run(command="INFERBOOK_GIT_COMMIT=<same> INFERBOOK_GIT_DIRTY=<0|1> PART=2/2 bash scripts/gpu_measure.sh", timeout_s=600)
# (each returns $OUT/results-partK.tar.gz; unpack both over the checkout and commit data/results/).
# Records also carry git.tree_sha256 (src/inferbook, chapters, scripts), which identifies the code even
# when the commit is not given or the tree was dirty.
#
#   usage: bash scripts/gpu_measure.sh [SLUG ...]
#   env:   DEVICE (cuda), PRESET (gpu), PART (K/N: the K-th of N parts), TOTAL_S (720; 590 with PART),
#          CEILINGS_TIMEOUT (20), KILL_GRACE (3),
#          PER_CHAPTER_TIMEOUT (only for presets without
#          budgets, default 150 s), PYTHON (python3), OUT (/tmp/inferbook-out), LOG_DIR (logs),
#          INFERBOOK_REFERENCE_DIR (data/results)
#   a dry run on a CPU machine (a test in the suite runs it):
#          DEVICE=cpu PRESET=smoke INFERBOOK_REFERENCE_DIR=/tmp/ref OUT=/tmp/out bash scripts/gpu_measure.sh upgrade-record
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
DEVICE="${DEVICE:-cuda}"; PRESET="${PRESET:-gpu}"; PY="${PYTHON:-python3}"
# One device command may run at most 600 s: PART=1/2 and PART=2/2 split the sixteen chapters into two
# calls of about 6 minutes each (`inferbook budgets --table --part K/N` lists them), each within its own total.
TOTAL_S="${TOTAL_S:-$([ -n "${PART:-}" ] && echo 590 || echo 720)}"
OUT="${OUT:-/tmp/inferbook-out}"; LOG_DIR="${LOG_DIR:-logs}"; REF="${INFERBOOK_REFERENCE_DIR:-data/results}"
mkdir -p "$OUT" "$LOG_DIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 INFERBOOK_REFERENCE_DIR="$REF"
elapsed() { echo $(( $(date +%s) - START )); }

# The commit: git where there is a .git, else what the caller passed, else a .git-commit file.
if git rev-parse HEAD >/dev/null 2>&1; then
  export INFERBOOK_GIT_COMMIT="$(git rev-parse HEAD)"
  export INFERBOOK_GIT_DIRTY="$(git diff --quiet HEAD 2>/dev/null && echo 0 || echo 1)"
else
  export INFERBOOK_GIT_COMMIT="${INFERBOOK_GIT_COMMIT:-$(cat .git-commit 2>/dev/null || echo unknown)}"
fi
[ "$INFERBOOK_GIT_COMMIT" = unknown ] && echo "warning: commit unknown; pass INFERBOOK_GIT_COMMIT (see the header)" | tee "$LOG_DIR/commit.txt"
echo "commit $INFERBOOK_GIT_COMMIT dirty ${INFERBOOK_GIT_DIRTY:-?}" >> "$LOG_DIR/commit.txt"

# CUDA binutils (cuobjdump, nvdisasm, ptxas) from Triton's bundle, ahead of whatever PATH holds.
TRITON_BIN="$("$PY" -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin"))' 2>/dev/null)"
[ -n "$TRITON_BIN" ] && [ -d "$TRITON_BIN" ] && export PATH="$TRITON_BIN:$PATH"
# PyAV is not in the bare GPU image: wheels carried in .whl/ are installed; without them the chapters
# that write video say so in one line (exit 2) and the others run.
if ! "$PY" -c 'import av' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install --no-index --find-links .whl av > "$LOG_DIR/pip-av.log" 2>&1 || echo "PyAV wheels did not install (see pip-av.log)"
fi

# The optional peers (fla-core with its einops, torchao, gemlite, liger-kernel): `make wheelhouse` puts their wheels in
# .wheelhouse/ (carried to the device with the working tree); they install offline, without dependencies
# (torch and triton are the image's), into .peers/ on PYTHONPATH, leaving the image's environment alone.
PEERS="fla:fla-core torchao:torchao gemlite:gemlite liger_kernel:liger-kernel"   # module:distribution
if [ -d .wheelhouse ] && ls .wheelhouse/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install --no-index --no-deps --find-links .wheelhouse --target .peers --upgrade .wheelhouse/*.whl \
    > "$LOG_DIR/pip-peers.log" 2>&1 || echo "peer wheels did not all install (see pip-peers.log)"
  export PYTHONPATH="$PWD/.peers:$PYTHONPATH"
fi
for pair in $PEERS; do
  m="${pair%%:*}"; dist="${pair#*:}"
  v="$("$PY" -c "import importlib, importlib.metadata as md; importlib.import_module('$m'); print(md.version('$dist'))" 2>/dev/null)"
  echo "$dist ${v:-absent}"
done | tee "$LOG_DIR/peers.txt" | sed 's/^/peer: /'

slugs=("$@")
PART="${PART:-}"
if [ ${#slugs[@]} -eq 0 ] && [ -n "$PART" ]; then
  mapfile -t slugs < <("$PY" -m inferbook.cli budgets --table --preset "$PRESET" --part "$PART" | grep -v '^#' | cut -d' ' -f1)
elif [ ${#slugs[@]} -eq 0 ]; then
  mapfile -t slugs < <("$PY" -c "from inferbook import book; print('\n'.join(c.slug for c in book.built_chapters()))")
fi
declare -A TIMEOUT=()
while read -r slug m c t; do [ "${slug:0:1}" = "#" ] || TIMEOUT[$slug]=$t; done \
  < <("$PY" -m inferbook.cli budgets --table --preset "$PRESET" 2>/dev/null)

# The GPU as its vendor's tool sees it: nvidia-smi on NVIDIA, rocm-smi on AMD (a ROCm build of PyTorch
# runs the same chapters through torch.cuda; the records name the gfx architecture).
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$LOG_DIR/gpu-smi.txt" 2>&1
elif command -v rocm-smi >/dev/null 2>&1; then
  { rocm-smi --showproductname --showmeminfo vram --showdriverversion 2>&1; } > "$LOG_DIR/gpu-smi.txt"
else
  echo "neither nvidia-smi nor rocm-smi on PATH" > "$LOG_DIR/gpu-smi.txt"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', getattr(torch.version, 'hip', None))" \
  >> "$LOG_DIR/gpu-smi.txt" 2>&1
timeout -s INT -k 3 "${CEILINGS_TIMEOUT:-20}" "$PY" -m inferbook.cli ceilings --device "$DEVICE" --save-reference \
  > "$LOG_DIR/ceilings.log" 2>&1
echo "ceilings: exit $? ($(tail -n 1 "$LOG_DIR/ceilings.log")) at $(elapsed) s"
printf "chapter\texit\tseconds\tlast line\n" > "$LOG_DIR/summary.tsv"
GRACE="${KILL_GRACE:-3}"   # inferbook.presets.KILL_GRACE_S
# Warm the Triton cache before the chapters (each part warms its own): compile every gpu-preset launch of
# the kernel chapters given, for this GPU, on every core, into the cache the chapters' JIT reads, so a
# chapter pays a cache load per kernel instead of a cold compile (`inferbook budgets` prices both; about
# 350 specialisations in all, ~3 s of CPU each). Best effort and bounded (WARM_TIMEOUT, inferbook.presets
# .WARM_TIMEOUT_S): where the runtime's cache key differs from the ahead-of-time one, the chapter compiles.
if [ "$DEVICE" = cuda ]; then
  WARM_SLUGS="$("$PY" -c "import sys
from inferbook import compiled
k = set(compiled.kernel_chapters()); print(','.join(s for s in sys.argv[1:] if s in k))" "${slugs[@]}" 2>/dev/null)"
  if [ -n "$WARM_SLUGS" ]; then
    timeout -k 3 "${WARM_TIMEOUT:-$("$PY" -c 'from inferbook import presets; print(presets.WARM_TIMEOUT_S)')}" "$PY" -c "import os, sys, torch
from inferbook import compiled
cap = torch.cuda.get_device_capability(); t = f'sm_{cap[0]}{cap[1]}'
if t in compiled.TARGETS:
    compiled.inspect(sys.argv[1].split(','), [t], jobs=os.cpu_count() or 4,
                     cache_dir=os.environ.get('TRITON_CACHE_DIR') or os.path.expanduser('~/.triton/cache'))" \
      "$WARM_SLUGS" > "$LOG_DIR/warm-triton.log" 2>&1
    echo "warm Triton cache ($WARM_SLUGS): exit $? at $(elapsed) s"
  fi
fi
for slug in "${slugs[@]}"; do
  left=$(( TOTAL_S - 5 - GRACE - $(elapsed) ))   # 5 s to pack the tarball
  t="${TIMEOUT[$slug]:-${PER_CHAPTER_TIMEOUT:-150}}"
  [ "$t" -gt "$left" ] && t="$left"
  if [ "$t" -lt 10 ]; then
    printf "%s\tskipped\t0\tout of time (%s s left of %s)\n" "$slug" "$left" "$TOTAL_S" >> "$LOG_DIR/summary.tsv"
    echo "== $slug: skipped, out of time"; continue
  fi
  t0=$(date +%s)
  # SIGINT first: Python saves the partial records and exits; SIGKILL $GRACE s later if it does not.
  timeout -s INT -k "$GRACE" "$t" "$PY" -m inferbook.cli measure "$slug" --device "$DEVICE" --preset "$PRESET" \
    --save-reference > "$LOG_DIR/$slug.log" 2>&1
  rc=$?
  last="$(tail -n 1 "$LOG_DIR/$slug.log" | tr '\t' ' ')"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    last="stopped at its ${t} s timeout; what it had measured is kept in its .partial.json ($last)"
  fi
  printf "%s\t%s\t%s\t%s\n" "$slug" "$rc" "$(( $(date +%s) - t0 ))" "$last" >> "$LOG_DIR/summary.tsv"
  echo "== $slug: exit $rc in $(( $(date +%s) - t0 )) s (limit $t s): $last"
done
echo "total $(elapsed) s of $TOTAL_S s"
# Which peers ran: the backends the saved records name (a peer installed but never selected did not run).
"$PY" - "$REF" <<'PYEOF' | tee -a "$LOG_DIR/peers.txt"
import json, pathlib, sys
peers = ("fla", "torchao", "gemlite", "liger")
ran = {}
for f in pathlib.Path(sys.argv[1]).glob("*/*.json"):
    try:
        recs = json.loads(f.read_text()).get("records", [])
    except Exception:
        continue
    for r in recs:
        for op, b in (r.get("backends") or {}).items():
            name = str(b.get("backend", "")).lower()
            for p in peers:
                if p in name:
                    ran.setdefault(p, set()).add(f.stem)
for p in peers:
    print(f"ran {p}: {', '.join(sorted(ran[p])) if p in ran else 'no record names it'}")
PYEOF
BUNDLE="$OUT/results${PART:+-part${PART%/*}}.tar.gz"
tar czf "$BUNDLE" "$REF" "$LOG_DIR" 2>/dev/null || tar czf "$BUNDLE" "$LOG_DIR"
echo "bundle: $BUNDLE"
