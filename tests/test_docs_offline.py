"""/docs renders offline: the page loads Swagger UI from our own server, and a real headless
browser (Debian's chromium) shows every operation. Skips only where no chromium is installed
(.ci/run installs it best-effort).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.serving import serve

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


@pytest.fixture(scope="module")
def srv(tiny_embedding_dir):
    server = serve(tiny_embedding_dir)
    yield server
    server.stop()


def test_docs_page_names_no_remote_asset(srv):
    html = httpx.get(srv.url + "/docs").text
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert assets and all(a.startswith("/docs/static/") for a in assets), assets
    assert "cdn" not in html.lower()
    for asset in assets:
        r = httpx.get(srv.url + asset)
        assert r.status_code == 200 and len(r.content) > 500, asset
    assert httpx.get(srv.url + "/redoc").status_code == 404  # not shipped: off, not blank


def _browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def _run_browser(browser: str, *args: str, tmp: Path) -> subprocess.CompletedProcess:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", f"--user-data-dir={tmp / 'profile'}", "--virtual-time-budget=15000", *args]
    # NOTE: no proxy and no network needed: every asset is on 127.0.0.1.
    env = {**os.environ, "HOME": str(tmp)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_docs_render_in_headless_chromium(srv, tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip("no chromium installed (apt-get install chromium)")
    dom = _run_browser(browser, "--dump-dom", srv.url + "/docs", tmp=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    # Swagger UI built the operation list from /openapi.json: each route is a rendered block.
    rendered = set(re.findall(r'data-path="([^"]+)"', dom.stdout))
    for path in ("/embed", "/embed_all", "/similarity", "/decode", "/invocations", "/v1/embeddings",
                 "/v1/embed", "/v2/embed", "/v2/rerank", "/v1/models", "/info", "/ping"):
        assert path in rendered, (path, sorted(rendered))
    shot = Path(os.environ.get("RADIXSERVE_DOCS_SCREENSHOT", tmp_path / "docs.png"))
    png = _run_browser(browser, f"--screenshot={shot}", "--window-size=1280,1600", srv.url + "/docs", tmp=tmp_path)
    assert png.returncode == 0 and shot.is_file() and shot.stat().st_size > 20_000, png.stderr[-2000:]
