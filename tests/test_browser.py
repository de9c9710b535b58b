"""The built book works offline in a real browser: a chapter page loads, its chart is
drawn, and no request leaves the machine. Needs Debian's chromium (.ci/run installs it)."""
import functools
import http.server
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from inferbook import book

pytestmark = pytest.mark.browser
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
EXTERNAL = re.compile(r"""(?:src|href|action|poster|data)\s*=\s*["'](?:https?:)?//""", re.I)


@pytest.fixture(scope="module")
def built_book(tmp_path_factory):
    """The real book, with upgrade-record executed at smoke on CPU and every other chapter a placeholder."""
    build = tmp_path_factory.mktemp("build")
    old = os.environ.get("INFERBOOK_BUILD_DIR")
    os.environ["INFERBOOK_BUILD_DIR"] = str(build)
    try:
        book.build_book(chapters=["upgrade-record"], device="cpu", preset="smoke", progress=False, log=lambda *_: None)
    finally:
        if old is None:
            os.environ.pop("INFERBOOK_BUILD_DIR")
        else:
            os.environ["INFERBOOK_BUILD_DIR"] = old
    return build / "html"


def test_no_page_names_an_external_host(built_book):
    pages = list(built_book.rglob("*.html"))
    assert len(pages) >= 3
    for page in pages:
        text = page.read_text()
        found = EXTERNAL.findall(text) + re.findall(r"<script[^>]*>[^<]*https?://", text)
        assert not found, f"{page.relative_to(built_book)} references an external host: {found[:3]}"
    for css in built_book.rglob("*.css"):
        assert not re.search(r"(@import|url\()\s*['\"]?(https?:)?//", css.read_text()), css.name


@pytest.fixture
def server(built_book):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(built_book))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_chapter_page_draws_its_chart_offline(server):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: .ci/run installs it with apt-get")
        pytest.skip("chromium not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    left_machine, failed = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        page = browser.new_page()

        def guard(route):
            if route.request.url.startswith(server):
                route.continue_()
            else:  # outside network refused, and remembered
                left_machine.append(route.request.url)
                route.abort()

        page.route("**/*", guard)
        page.on("requestfailed", lambda r: failed.append(r.url))
        page.goto(f"{server}/chapters/upgrade-record.html", wait_until="networkidle")
        assert "The record to keep before upgrading" in page.title()
        charts = page.eval_on_selector_all(
            ".cell_output img",
            "els => els.filter(e => e.src.endsWith('.svg')).map(e => [e.src, e.complete, e.naturalWidth, e.naturalHeight])")
        assert charts, "no chart image in the chapter's outputs"
        for src, complete, w, h in charts:
            assert complete and w > 100 and h > 50, f"chart not drawn: {src} {w}x{h}"
        svg = page.request.get(charts[0][0]).text()
        assert svg.count('aria-roledescription="bar"') >= 12, "the chart's bars are not drawn"
        assert "Phases kept apart" in svg
        browser.close()
    assert not left_machine, f"requests left the machine: {left_machine}"
    assert not failed, f"requests failed: {failed}"
