"""``/openapi.json`` documents the request bodies the routes read by hand.

The routes read their bodies through ``ServerContext.parse`` (bounded reader, 413 before
the body is read, UTF-8 and nesting checks, then pydantic), so FastAPI never sees a body
parameter and would document none. Each route instead declares its model with
``openapi_extra=request_body(Model)`` (a ``$ref`` into ``components.schemas``), and
``publish_models`` adds those models' JSON schemas (``model_json_schema`` of pydantic,
nested models included) to the generated document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``model``."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def publish_models(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` include the schemas of ``models`` (and of their parts)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(defs.get("$defs", {}))
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
