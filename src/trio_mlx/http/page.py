"""The chat page: `GET /` in a browser, and its files under `/page/`.

The page is static HTML, CSS and JavaScript shipped inside the package (`trio_mlx/http/page/`,
package data): no build step and nothing fetched from elsewhere, so it works offline. It talks to
the server's own `/v1/models` and `/v1/chat/completions` (streamed); see `page/chat.js`.

`GET /` is the page for a client that prefers HTML (a browser), and for any other (curl, an
SDK: `Accept: */*` or JSON) the server's JSON index as before (name, phase, models, where the
OpenAPI document is). Both, and the page's files, are open without the API key
(`http/api_key.py`). The files are sent with a Content-Security-Policy that allows only this
origin's scripts, styles and connections, so that nothing an answer contains can load or run
anything even if it reached the DOM as markup.
"""

from __future__ import annotations

import json
import time
from functools import cache
from importlib import resources

from quart import Response, request
from quart_trio import QuartTrio

from trio_mlx.http.errors import NOT_FOUND, APIError
from trio_mlx.http.state import ServerState

#: The page's files and their media types; nothing else under /page/ is served.
PAGE_FILES = {
    "index.html": "text/html; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "api.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "sse.js": "text/javascript; charset=utf-8",
    "icon.svg": "image/svg+xml",
}

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a new version of the server serves a new page
}


@cache
def page_file(name: str) -> bytes:
    """The bytes of one of the page's files (read from the package once)."""
    if name not in PAGE_FILES:
        raise KeyError(name)
    return resources.files("trio_mlx.http").joinpath("page", name).read_bytes()


def _file_response(name: str) -> Response:
    return Response(page_file(name), content_type=PAGE_FILES[name], headers=_HEADERS)


def add_page_routes(app: QuartTrio, state: ServerState) -> None:
    """Register `GET /` (the page or the JSON index) and `GET /page/<name>`."""

    @app.get("/")
    async def root_route() -> Response:
        preferred = request.accept_mimetypes.best_match(["application/json", "text/html"])
        if preferred == "text/html":
            response = _file_response("index.html")
        else:
            index = {
                "name": "trio-mlx",
                "status": state.phase,
                "models": state.model_names,
                "time": int(time.time()),
                "docs": "/openapi.json",
                "chat": "/ (in a browser)",
            }
            response = Response(
                json.dumps(index, separators=(",", ":")), content_type="application/json"
            )
        response.vary.add("Accept")
        return response

    @app.get("/page/<name>")
    async def page_route(name: str) -> Response:
        if name not in PAGE_FILES:
            raise APIError(404, f"no page file {name!r}", type=NOT_FOUND, code="not_found")
        return _file_response(name)
