"""Diagrams drawn by code: valid SVG, sized to the page, drawn from the numbers they are given."""
import xml.etree.ElementTree as ET

import pytest

from inferbook import diagrams as D

NS = "{http://www.w3.org/2000/svg}"


def _svg(fig):
    root = ET.fromstring(fig.svg)
    assert root.tag == f"{NS}svg"
    assert float(root.get("width")) <= D.MAX_WIDTH
    return root


def test_tiles_draw_one_rect_per_tile_and_name_the_batches():
    tiles = [(0, 0, 12, 12), (0, 6, 12, 12), (0, 12, 12, 12), (4, 0, 12, 12)]
    root = _svg(D.tiles_over_latent(16, 24, tiles, overlap=6, batches=[[0, 1, 2], [3]]))
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert sum(1 for t in texts if t.startswith("tile ")) == 4
    assert "batch 1: tiles 3" in texts


def test_split_plans_draw_every_chunk():
    plans = {"fixed": [[64, 64, 10], [64]], "adaptive": [[69, 69], [64]]}
    root = _svg(D.split_plans(plans, tile=32))
    chunks = [r for r in root.iter(f"{NS}rect") if float(r.get("width")) > 1]
    assert len(chunks) == 3 + 1 + 2 + 1


@pytest.mark.parametrize("fig", [D.kv_data_path(), D.w4a16_packings({"a": [(0, [f"k{i}" for i in range(8)]), (16, [f"k{i + 8}" for i in range(8)])]})])
def test_fixed_figures_are_valid_and_fit(fig):
    root = _svg(fig)
    assert fig._repr_mimebundle_()[0]["image/svg+xml"].startswith("<svg")
    assert len(list(root.iter(f"{NS}text"))) > 5
