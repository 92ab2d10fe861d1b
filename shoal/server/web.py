"""The browser pages: the playground at `/`, the dashboard at `/dashboard`, the voice library at
`/voices`, and their assets under `/web/` (plain HTML, CSS and JavaScript modules shipped in the
package as `shoal/server/web/`: no build step, nothing fetched from elsewhere).

The pages hold no secret and need no key: they call the API from the browser with the key the
user types (docs/playground.md). They are left out of the OpenAPI document: they are not API.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from shoal.server.errors import ApiError

WEB_DIR = Path(__file__).with_name("web")
PAGES = {"/": "playground.html", "/dashboard": "dashboard.html", "/voices": "voices.html"}
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
# Only this origin's scripts and styles run (no inline code), so a voice title or an error
# message that reaches the page as markup cannot execute; played audio comes from blob: URLs.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; media-src 'self' blob:; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",  # revalidate, so an upgraded server's pages are seen at once
}

router = APIRouter(include_in_schema=False)


def asset_response(name: str) -> FileResponse:
    path = WEB_DIR / name
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=HEADERS)


def serve_page(name: str):
    async def page() -> FileResponse:
        return asset_response(name)

    return page


for route, file_name in PAGES.items():
    router.add_api_route(route, serve_page(file_name), methods=["GET", "HEAD"], name=f"page:{file_name}")


@router.api_route("/web/{name}", methods=["GET", "HEAD"])
async def web_asset(name: str) -> FileResponse:
    """One of the files shipped in `web/` (a flat directory; nothing else is reachable)."""
    path = WEB_DIR / name
    if "/" in name or path.suffix not in MEDIA_TYPES or not path.is_file():
        raise ApiError(404, f"no such web asset: {name}")
    return asset_response(name)
