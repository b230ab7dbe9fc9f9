"""``GET /docs`` (Swagger UI) and ``GET /redoc`` (ReDoc) over ``/openapi.json``, as
FastAPI serves them for vLLM, but with every asset served by this server.

FastAPI's own pages load Swagger UI and ReDoc from a CDN; these pages load the files
the ``fastapi-offline`` package ships (``fastapi_offline/static``) from
``/docs-static/NAME``, so they work on a host that reaches nothing outside and send no
visitor to a third party. They follow ``/openapi.json``'s key rule (``--open-endpoints``'s
``openapi``) and disappear with it under ``--disable-fastapi-docs``. Only the files in
``ASSETS`` are served, so the path can name nothing else on disk.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from kvstack.serve.api.context import ServerContext
from kvstack.serve.api.http_errors import ApiError

ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}
PREFIX = "/docs-static/"


def asset_bytes(name: str) -> bytes:
    """The shipped file ``name`` (one of ``ASSETS``)."""
    return resources.files("fastapi_offline").joinpath("static", name).read_bytes()


def docs_router(ctx: ServerContext, title: str) -> APIRouter:
    """``/docs``, ``/redoc`` and their assets, behind ``/openapi.json``'s key rule."""
    r = APIRouter()

    def base(raw: Request) -> str:
        ctx.check_ops_auth(raw, "openapi")
        return str(raw.scope.get("root_path", "")).rstrip("/")

    @r.get("/docs", include_in_schema=False)
    async def swagger(raw: Request) -> HTMLResponse:
        root = base(raw)
        return get_swagger_ui_html(
            openapi_url=f"{root}/openapi.json", title=f"{title} - Swagger UI",
            swagger_js_url=f"{root}{PREFIX}swagger-ui-bundle.js",
            swagger_css_url=f"{root}{PREFIX}swagger-ui.css",
            swagger_favicon_url=f"{root}{PREFIX}favicon.png",
        )  # fmt: skip

    @r.get("/redoc", include_in_schema=False)
    async def redoc(raw: Request) -> HTMLResponse:
        root = base(raw)
        return get_redoc_html(
            openapi_url=f"{root}/openapi.json", title=f"{title} - ReDoc",
            redoc_js_url=f"{root}{PREFIX}redoc.standalone.js",
            redoc_favicon_url=f"{root}{PREFIX}favicon.png", with_google_fonts=False,
        )  # fmt: skip

    @r.get(PREFIX + "{name}", include_in_schema=False)
    async def asset(name: str, raw: Request) -> Response:
        base(raw)
        if name not in ASSETS:
            raise ApiError(404, f"no such file: {name}", "NotFoundError")
        data = await ctx.off_loop(lambda: asset_bytes(name))
        return Response(data, media_type=ASSETS[name])

    return r
