"""One measure module per chapter, named after its slug: `measure(ctx, **params) -> list[RunRecord]`,
`PARAMETERS`, `PRESETS`, and the row/sentence helpers that chapter's page shows.

This package sits above the topic packages (`diffusion`, `serving`, `moe`, ...): it imports them,
nothing below imports it. `inferbook.toc` names which module belongs to which chapter.
"""
