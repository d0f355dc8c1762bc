"""The FastAPI app: read-only GET routes over a data source, and the static page."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from dashboard import metrics
from dashboard.auth import BearerTokenMiddleware
from dashboard.models import Health, HistoryOut, NodeOut, SwarmOut
from dashboard.settings import DashboardSettings
from dashboard.sources import STALE_AFTER_POLLS, DataSource
from dashboard.view import DEFAULT_PAGE_SIZE, swarm_out
from dht.pages import MAX_PAGE_SIZE

STATIC_DIR = Path(__file__).parent / "static"
DOCS_ASSETS = "/docs-assets"


def swagger_ui_dir() -> Path | None:
    """Swagger UI's files as the swagger-ui-py package ships them; None when it is missing."""
    try:
        import swagger_ui
    except ImportError:
        return None
    directory = Path(swagger_ui.__file__).parent / "static"
    return directory if (directory / "swagger-ui-bundle.js").is_file() else None


def get_source(request: Request) -> DataSource:
    source: DataSource = request.app.state.source
    return source


def get_settings(request: Request) -> DashboardSettings:
    settings: DashboardSettings = request.app.state.settings
    return settings


def get_registry(request: Request) -> CollectorRegistry:
    registry: CollectorRegistry = request.app.state.registry
    return registry


SourceDep = Annotated[DataSource, Depends(get_source)]
SettingsDep = Annotated[DashboardSettings, Depends(get_settings)]
RegistryDep = Annotated[CollectorRegistry, Depends(get_registry)]
router = APIRouter()


@router.get("/api/swarm")
def read_swarm(
    source: SourceDep,
    page: Annotated[int, Query(ge=1)] = 1,
    page_size: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = DEFAULT_PAGE_SIZE,
) -> SwarmOut:
    """The swarm's totals, summary and rejections over every peer seen (live and dead), and
    one page of those peers: live first, then by organization and peer id. A page past the
    last gives the last."""
    return swarm_out(source.state(), page, page_size)


@router.get("/api/node", responses={404: {"description": "standalone: there is no local node"}})
def read_node(source: SourceDep) -> NodeOut:
    """The node serving this dashboard, with its rejection counters (embedded mode only)."""
    node = source.node()
    if node is None:
        raise HTTPException(404, "this dashboard runs standalone: it has no local node")
    return node


@router.get("/api/history")
def read_history(
    source: SourceDep, max_points: Annotated[int | None, Query(ge=2, le=10_000)] = None
) -> HistoryOut:
    """Time series for the charts, oldest first; max_points thins each series evenly."""
    return source.history.to_out(max_points)


@router.get("/metrics", response_class=Response)
def read_metrics(registry: RegistryDep) -> Response:
    """Prometheus text format."""
    return Response(metrics.render(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz", responses={503: {"model": Health}})
def read_health(source: SourceDep, settings: SettingsDep, response: Response) -> Health:
    """ok while the swarm is read on schedule; 503 and stale when reading it keeps failing."""
    state = source.state()
    age = source.data_age_s()
    stale = age is None or age > STALE_AFTER_POLLS * settings.poll_period_s
    if stale:
        response.status_code = 503
    return Health(
        status="stale" if stale else "ok",
        mode=source.mode,
        peers_alive=len(state.alive),
        data_age_s=None if age is None else round(age, 2),
    )


@router.get("/", include_in_schema=False)
def read_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def _offline_docs(app: FastAPI) -> None:
    """/docs from local files only (no CDN): Swagger UI when installed, else a plain list."""
    assets = swagger_ui_dir()
    if assets is not None:
        app.mount(DOCS_ASSETS, StaticFiles(directory=assets), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def read_docs() -> HTMLResponse:
        if assets is None:
            return HTMLResponse(docs_page(app.openapi()))
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{app.title} - API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )


def docs_page(schema: dict[str, object]) -> str:
    """A minimal API reference generated from the OpenAPI schema: method, path, summary."""
    rows = []
    paths = schema.get("paths", {})
    assert isinstance(paths, dict)
    for path, operations in sorted(paths.items()):
        for method, operation in operations.items():
            summary = html.escape(str(operation.get("description") or operation.get("summary")))
            rows.append(f"<tr><td>{method.upper()}</td><td><code>{html.escape(path)}</code></td>"
                        f"<td>{summary}</td></tr>")  # fmt: skip
    return (
        "<!doctype html><title>diloco-node dashboard API</title><h1>API</h1>"
        '<p>Schema: <a href="/openapi.json">/openapi.json</a></p>'
        f"<table>{''.join(rows)}</table>"
    )


def create_app(source: DataSource, settings: DashboardSettings) -> FastAPI:
    app = FastAPI(
        title="diloco-node dashboard",
        description="Read-only view of a diloco-node swarm.",
        openapi_url="/openapi.json",
        docs_url=None,  # FastAPI's default pages load Swagger UI and ReDoc from a CDN
        redoc_url=None,
    )
    app.state.source = source
    app.state.settings = settings
    app.state.registry = metrics.metrics_registry(source)
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    _offline_docs(app)
    if settings.token is not None:
        app.add_middleware(BearerTokenMiddleware, token=settings.token)
    return app
