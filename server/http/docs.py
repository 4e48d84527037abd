"""/docs served offline: Swagger UI's assets come from the swagger-ui-bundle-v2 wheel, not a CDN.

FastAPI's default /docs page loads swagger-ui-dist from jsdelivr, so it is blank on a machine
without internet. Here the same page points at /docs/static/..., served from the package's copy of
swagger-ui-dist (5.x, which renders the OpenAPI 3.1 that FastAPI writes). ReDoc is not shipped by
any such package, so /redoc is off rather than blank.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

STATIC = "/docs/static"


def assets_dir():
    import swagger_ui_bundle  # swagger-ui-bundle-v2: swagger-ui-dist inside a wheel

    return swagger_ui_bundle.swagger_ui_path


def install_docs(app: FastAPI, *, title: str) -> None:
    """GET /docs, /docs/oauth2-redirect and /docs/static/* (the app has docs_url=None)."""
    app.mount(STATIC, StaticFiles(directory=str(assets_dir())), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{title} - API",
            swagger_js_url=f"{STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{STATIC}/favicon-32x32.png",
            oauth2_redirect_url="/docs/oauth2-redirect",
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
