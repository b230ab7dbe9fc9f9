"""The web view: the page at ``GET /`` (static files from ``serve/ui/static/``), its state
stream ``GET /v1/kv/state``, the prefix list ``GET /v1/kv/prefixes`` and
``GET /v1/kv/view`` (open: whether the page must ask for a key).

The page and its scripts are static and hold no data, so they need no key; everything
the page shows comes from the API routes, which need the API key like any other (the
page asks for it, keeps it in memory and sends it as ``Authorization: Bearer``). The
files are plain ES modules and CSS committed under the package: no CDN, no build step.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from kvstack.serve.api.context import ServerContext
from kvstack.serve.api.http_errors import ApiError
from kvstack.serve.ui.kv_state_stream import ClosingStreamingResponse, KVStateStream

STATIC_DIR = Path(__file__).parent / "static"
TEXT_TOKENS = 24  # tokens of each prefix node decoded for the page
PREFIX_TREE_MIN_S = 1.0  # one tree per second at most, whoever asks


def _interval(raw: Request) -> float:
    """``?interval_ms=`` as seconds (default 500 ms); 400 when not a number."""
    value = raw.query_params.get("interval_ms", "500")
    try:
        ms = float(value)
    except ValueError:
        raise ApiError(400, "interval_ms must be a number", param="interval_ms") from None
    if not math.isfinite(ms):
        raise ApiError(400, "interval_ms must be finite", param="interval_ms")
    return ms / 1000.0


def _limit(raw: Request) -> int:
    value = raw.query_params.get("limit", "40")
    if not value.isdigit() or not 1 <= int(value) <= 200:
        raise ApiError(400, "limit must be an integer in [1, 200]", param="limit")
    return int(value)


def ui_router(ctx: ServerContext, state: KVStateStream) -> APIRouter:
    r = APIRouter()
    engine = ctx.engine

    @r.get("/", include_in_schema=False)
    async def index() -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @r.get("/v1/kv/view")
    async def view_info() -> dict[str, Any]:
        """What the page needs before it has a key: whether the server wants one (no data:
        any 401 says as much). The page then asks for the key before it sends a request
        that would fail, so a fresh load logs no error in the browser's console."""
        return {"api_key_required": ctx.config.api_key is not None}

    @r.get("/v1/kv/state")
    async def kv_state(raw: Request) -> Response:
        """Snapshots of the KV cache as Server-Sent Events (``serve/ui/kv_state_stream.py``)."""
        ctx.check_auth(raw)
        interval = _interval(raw)
        if not engine.alive or state.closed:
            raise ApiError(503, "the server is shutting down", "server_error")
        stream = state.open_stream(interval)
        if stream is None:
            raise ApiError(
                429, f"{state.max_viewers} KV state streams are open already",
                "rate_limit_error", headers={"Retry-After": "5"},
            )  # fmt: skip
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return ClosingStreamingResponse(stream, media_type="text/event-stream", headers=headers)

    trees: dict[int, tuple[float, dict[str, Any]]] = {}  # limit -> (monotonic, tree)

    @r.get("/v1/kv/prefixes")
    async def prefixes(raw: Request) -> dict[str, Any]:
        """The hottest cached prefixes as a tree (``serve/ui/prefix_view.py``)."""
        ctx.check_auth(raw)
        limit = _limit(raw)
        got = trees.get(limit)
        if got is not None and time.monotonic() - got[0] < PREFIX_TREE_MIN_S:
            return got[1]
        tree = await engine.run(lambda: engine.prefix_tree(limit))

        def decode() -> dict[str, Any]:
            for n in tree.nodes:
                n.text = ctx.tokenizer.decode(n.ids[:TEXT_TOKENS], skip_special_tokens=False)
            return tree.to_dict()

        out = await ctx.off_loop(decode)
        trees.clear()  # one cached tree: bounded whatever limits clients send
        trees[limit] = (time.monotonic(), out)
        return out

    return r


def mount_ui(app: FastAPI, ctx: ServerContext, state: KVStateStream) -> None:
    """Add the page, its static files and its API routes to ``app``."""
    app.include_router(ui_router(ctx, state))
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
