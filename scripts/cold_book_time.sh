#!/usr/bin/env bash
# Time a cold `make book` (set-up included) of this checkout's HEAD in a fresh clone, as a new user would
# run it: no .venv, no _build. Prints wall, user+sys CPU, the load average before and after (the
# figure is only meaningful on an otherwise idle machine: check the load), and each chapter's seconds.
#   scripts/cold_book_time.sh [BOOK_ARGS...]     e.g. scripts/cold_book_time.sh --jobs 1
# Keeps the clone (path printed) so its _build/ can be inspected; remove it yourself.
set -euo pipefail
src=$(git rev-parse --show-toplevel)
work=$(mktemp -d "${TMPDIR:-/tmp}/cold-book.XXXXXX")
git clone -q --no-hardlinks "$src" "$work/repo"
cd "$work/repo"
# cold compiler caches too (Inductor's C++ and Triton's), as on a new machine: a warm one would hide compiles
export TORCHINDUCTOR_CACHE_DIR="$work/inductor-cache" TRITON_CACHE_DIR="$work/triton-cache"
echo "clone of $(git rev-parse --short HEAD) in $work/repo; cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
set +e
/usr/bin/time -f "%e %U %S" -o "$work/time" make book BOOK_ARGS="$*" > "$work/book.log" 2>&1
rc=$?
set -e
read -r wall user sys < "$work/time"
echo "make book exit $rc: wall ${wall} s, user+sys $(python3 -c "print(round($user + $sys, 1))") s; load after: $(cut -d' ' -f1-3 /proc/loadavg)"
grep -E "^\[[0-9]+/[0-9]+\]|book built" "$work/book.log" || tail -20 "$work/book.log"
python3 - "$work/repo/_build/executed" <<'PY'
import json, pathlib, sys
metas = sorted(pathlib.Path(sys.argv[1]).glob("*.meta.json"))
rows = [json.loads(m.read_text()) for m in metas if not m.name.endswith(".failed.meta.json")]
for r in rows:
    print(f"  {r['chapter']:26} {r.get('status', '?'):6} {r.get('seconds', 0):7.1f} s")
print(f"  sum of chapter seconds: {sum(r.get('seconds', 0) for r in rows):.1f}")
PY
exit $rc
