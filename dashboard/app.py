"""The FastAPI app: read-only GET routes over a data source, and the static page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from dashboard import metrics
from dashboard.auth import BearerTokenMiddleware
from dashboard.models import Health, HistoryOut, NodeOut, SwarmOut
from dashboard.settings import DashboardSettings
from dashboard.sources import STALE_AFTER_POLLS, DataSource
from dashboard.view import swarm_out

STATIC_DIR = Path(__file__).parent / "static"


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
def read_swarm(source: SourceDep) -> SwarmOut:
    """Every peer seen (live and dead) and the swarm's totals."""
    return swarm_out(source.state())


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


def create_app(source: DataSource, settings: DashboardSettings) -> FastAPI:
    app = FastAPI(
        title="diloco-node dashboard",
        description="Read-only view of a diloco-node swarm.",
        openapi_url="/openapi.json",
    )
    app.state.source = source
    app.state.settings = settings
    app.state.registry = metrics.metrics_registry(source)
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    if settings.token is not None:
        app.add_middleware(BearerTokenMiddleware, token=settings.token)
    return app
