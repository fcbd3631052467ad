"""The chat page's files: served from the package with their media types and a strict
Content-Security-Policy, shipped as package data, and `/` still the JSON index for API clients."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import httpx

from trio_mlx.http.page import PAGE_FILES, page_file

ROOT = Path(__file__).resolve().parents[2]
PAGE_DIR = ROOT / "src" / "trio_mlx" / "http" / "page"


def test_every_file_of_the_page_is_served_and_shipped_as_package_data() -> None:
    on_disk = {p.name for p in PAGE_DIR.iterdir() if p.is_file()}
    assert on_disk == set(PAGE_FILES)
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["trio_mlx.http"]
    for name in on_disk:
        assert any(fnmatch.fnmatch(f"page/{name}", g) for g in globs), name
        assert page_file(name) == (PAGE_DIR / name).read_bytes()


async def test_a_browser_gets_the_page_with_a_content_security_policy(
    http: httpx.AsyncClient,
) -> None:
    response = await http.get("/", headers={"Accept": "text/html,*/*;q=0.8"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert '<script type="module" src="/page/chat.js">' in response.text
    policy = response.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy
    assert "connect-src 'self'" in policy
    assert response.headers["x-content-type-options"] == "nosniff"
    assert "Accept" in response.headers["vary"]
    for name, media in PAGE_FILES.items():
        asset = await http.get(f"/page/{name}")
        assert asset.status_code == 200, name
        assert asset.headers["content-type"] == media
        assert asset.content == page_file(name)


async def test_an_api_client_still_gets_the_json_index_at_the_root(
    http: httpx.AsyncClient,
) -> None:
    index = (await http.get("/")).json()
    assert index["name"] == "trio-mlx" and index["status"] == "ready"
    assert index["models"] == ["tiny", "tiny-alias"]
    assert index["docs"] == "/openapi.json"


async def test_an_unknown_page_file_is_a_404_in_the_openai_shape(http: httpx.AsyncClient) -> None:
    for path in ("/page/nope.js", "/page/../app.py", "/page/"):
        response = await http.get(path)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
