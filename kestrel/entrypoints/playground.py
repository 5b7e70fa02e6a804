"""The browser playground: `GET /` is a chat page (streaming, sampling controls, model picker) with a live view of
`/metrics`; its scripts and styles are the package's files under `static/`, served at `/static/NAME`.

The page is static and holds no secret, so it loads without the API key, like /health; the key is typed into
the page and sent only by its own requests to the API. Only the files listed here are served (no directory
is exposed), each read once when the app is built.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
                "style.css": "text/css; charset=utf-8"}
# Everything the page loads or calls is this server: no inline script, no other origin, no framing.
HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' "
                                      "data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                                      "form-action 'none'",
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def add_playground_routes(app: FastAPI) -> None:
    """`GET /` and `GET /static/{name}`, outside the OpenAPI document (they are not part of the API)."""
    files = {name: (STATIC_DIR / name).read_bytes() for name in STATIC_FILES}

    def static(name: str) -> Response:
        return Response(files[name], media_type=STATIC_FILES[name], headers=HEADERS)

    @app.get("/", include_in_schema=False)
    async def playground() -> Response:
        return static("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str) -> Response:
        if name not in files:
            raise StarletteHTTPException(404, f"no static file {name!r}")
        return static(name)
