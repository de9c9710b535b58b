"""The dress rehearsal: each chapter's gpu-preset branches (dtypes, compile, named modes) run here on CPU
at smoke sizes, so a GPU-only branch that cannot run fails in this suite, not on the lent GPU.
Chapters whose gpu preset takes no branch the smoke preset does not are executed at smoke by
test_book_pages; they are listed, not run twice."""
import pytest

from inferbook import rehearsal, toc


def _differs_from_smoke(slug):
    m = rehearsal.chapter_module(slug)
    return {k: v for k, v in rehearsal.rehearsal_params(slug, fast=True).items() if m.PRESETS["smoke"].get(k) != v}


def test_the_rehearsal_keeps_every_branch_knob_of_the_gpu_preset():
    for slug in toc.CHAPTERS:
        m = rehearsal.chapter_module(slug)
        p = rehearsal.rehearsal_params(slug, fast=True)
        for name, value in m.PRESETS["gpu"].items():
            if rehearsal._is_branch(value, m.PARAMETERS.get(name)) and name not in rehearsal.FAST.get(slug, {}):
                assert p[name] == value, (slug, name)


@pytest.mark.chapter
@pytest.mark.parametrize("slug", list(toc.CHAPTERS))
def test_gpu_branches_run_here(slug, results_env):
    changed = _differs_from_smoke(slug)
    if not changed:
        pytest.skip("the gpu preset's branches are the smoke preset's: test_book_pages runs them")
    r = rehearsal.rehearse(slug, rehearsal.rehearsal_params(slug, fast=True))
    assert r["records"] > 0 and not r["checks_failed"], (changed, r["checks_failed"])
