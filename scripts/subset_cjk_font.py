"""Make the book's CJK font: Noto Sans CJK SC cut down to the characters the book's pages quote.

The seed is Chinese and every chapter quotes it; a reader without a CJK font would see empty boxes.
The whole Noto Sans CJK SC is ~16 MB; the subset of the few hundred characters the book uses is tens of KB,
so it is committed and served from `_static/` (no font CDN). Run again after adding Chinese text:

    apt-get install fonts-noto-cjk        # Debian: /usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc
    .venv/bin/pip install "fonttools[woff]"
    .venv/bin/python scripts/subset_cjk_font.py

`tests/test_repo.py` fails when a page's source has a CJK character the committed font lacks.
Noto Sans CJK is under the SIL Open Font License 1.1 (`_static/fonts/OFL.txt`).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path("/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc")
SC_INDEX = 2  # the collection's Simplified Chinese face
OUT = ROOT / "_static" / "fonts" / "inferbook-cjk.woff2"


def is_cjk(ch: str) -> bool:
    """CJK ideographs, CJK punctuation, and full-width forms: what the seed's quotes use."""
    o = ord(ch)
    return 0x3000 <= o <= 0x303F or 0x3400 <= o <= 0x4DBF or 0x4E00 <= o <= 0x9FFF or 0xFF00 <= o <= 0xFFEF


def book_sources() -> list[Path]:
    """Every file whose text reaches a page: chapters, part pages, front matter, and src/ (the table of
    contents and the chapters' glued sentences)."""
    files = [*ROOT.glob("chapters/*.md"), *ROOT.glob("parts/*.md"), *ROOT.glob("*.md"),
             *ROOT.glob("src/inferbook/**/*.py")]
    return sorted(f for f in files if f.name not in ("CONTRIBUTING.md",))


def used_characters() -> set[str]:
    return {ch for f in book_sources() for ch in f.read_text(encoding="utf-8") if is_cjk(ch)}


def main() -> int:
    from fontTools import subset
    from fontTools.ttLib import TTCollection

    chars = used_characters()
    font = TTCollection(str(SOURCE)).fonts[SC_INDEX]
    options = subset.Options()
    options.flavor = "woff2"
    options.layout_features = ["*"]
    options.name_IDs = ["*"]
    options.notdef_outline = True
    sub = subset.Subsetter(options)
    sub.populate(unicodes=[ord(c) for c in sorted(chars)])
    sub.subset(font)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    font.flavor = "woff2"
    font.save(str(OUT))
    print(f"{OUT.relative_to(ROOT)}: {len(chars)} characters, {OUT.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
