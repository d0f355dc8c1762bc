"""Experiment tracking: per-round figures of a node to TensorBoard and/or Weights & Biases.

A TrackedEventLog sits in front of the node's event log: every event passes through
unchanged, and RoundMetrics turns the stream into one row of scalars per round (loss, val
loss, tokens/s, staleness of the updates merged, drift, megabytes received, goodput). The
node's peer id, org, run and model are the tracked run's metadata. TensorBoard needs the
`tensorboard` package and W&B the `wandb` package (extra `pip install -e ".[tracking]"`).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Protocol

from node.config import JoinConfig
from node.events import EventLog

logger = logging.getLogger(__name__)

METADATA_FIELDS = ("peer_id", "run_id", "fingerprint", "model", "num_params", "device", "data")


class MetricSink(Protocol):
    def start(self, metadata: dict[str, Any]) -> None: ...

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class RoundMetrics:
    """Folds the event stream into per-round scalars; pure, so it is unit-tested alone."""

    def __init__(self) -> None:
        self._staleness: list[int] = []
        self._received_mb = 0.0
        self._merged = 0

    def observe(self, event: str, fields: dict[str, Any]) -> dict[str, float] | None:
        """The round's scalars when `event` closes a round, else None."""
        if event == "update_merged":
            self._staleness.append(int(fields["staleness"]))
            self._merged += 1
        elif event in ("update_fetched", "state_downloaded"):
            self._received_mb += float(fields.get("megabytes") or 0.0)
        elif event == "round_done":
            return self._close_round(fields)
        return None

    def _close_round(self, f: dict[str, Any]) -> dict[str, float]:
        scalars: dict[str, float] = {
            "loss": float(f["loss"]),
            "tokens_per_s": float(f["tokens_per_s"]),
            # The steps' own time (round_done before steps_s: the step loop's, inner_s).
            "goodput": float(f.get("steps_s", f["inner_s"])) / max(float(f["round_s"]), 1e-9),
            "received_mb": round(self._received_mb, 6),
            "updates_merged": float(self._merged),
            "num_applied": float(f["num_applied"]),
            "peers_alive": float(f.get("peers_alive") or 0),
        }
        if f.get("val_loss") is not None:
            scalars["val_loss"] = float(f["val_loss"])
        if f.get("drift") is not None:
            scalars["drift"] = float(f["drift"])
        if self._staleness:
            scalars["staleness_mean"] = sum(self._staleness) / len(self._staleness)
            scalars["staleness_max"] = float(max(self._staleness))
        self._staleness.clear()
        return scalars


class TrackedEventLog:
    """Passes every event on to `inner` and the per-round scalars to the sinks."""

    def __init__(self, inner: EventLog, sinks: list[MetricSink], org: str) -> None:
        self._inner = inner
        self._sinks = sinks
        self._org = org
        self._metrics = RoundMetrics()
        self._lock = threading.Lock()  # the swarm's merge thread emits too

    def emit(self, event: str, **fields: Any) -> None:
        self._inner.emit(event, **fields)
        with self._lock:
            if event == "started":
                metadata = {k: fields.get(k) for k in METADATA_FIELDS} | {"org": self._org}
                for sink in self._sinks:
                    sink.start(metadata)
            scalars = self._metrics.observe(event, fields)
            if scalars is not None:
                for sink in self._sinks:
                    sink.log(scalars, step=int(fields["round"]))

    def progress(self, **fields: Any) -> None:
        self._inner.progress(**fields)

    def close(self) -> None:
        with self._lock:
            for sink in self._sinks:
                sink.close()
        self._inner.close()


class TensorBoardSink:
    """Scalars under round/NAME, metadata as a text summary, in DIR/RUN_ID/PEER_ID."""

    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(
                '--tensorboard needs the tensorboard package: pip install -e ".[tracking]"'
            ) from None
        self._directory = directory
        self._writer_class = SummaryWriter
        self._writer: Any = None

    def start(self, metadata: dict[str, Any]) -> None:
        if self._writer is not None:
            return
        log_dir = self._directory / str(metadata["run_id"]) / str(metadata["peer_id"])
        self._writer = self._writer_class(log_dir=str(log_dir))
        table = "\n".join(f"| {k} | {v} |" for k, v in metadata.items())
        self._writer.add_text("node", "| field | value |\n|---|---|\n" + table, 0)

    def log(self, scalars: dict[str, float], step: int) -> None:
        if self._writer is None:
            return
        for name, value in scalars.items():
            self._writer.add_scalar(f"round/{name}", value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbSink:
    """A W&B run per node (group: the run id, name: the peer id); offline without an API key."""

    def __init__(self, project: str) -> None:
        try:
            import wandb
        except ImportError:
            raise ValueError(
                '--wandb needs the wandb package: pip install -e ".[tracking]"'
            ) from None
        self._wandb = wandb
        self._project = project
        self._run: Any = None

    def start(self, metadata: dict[str, Any]) -> None:
        if self._run is not None:
            return
        self._run = self._wandb.init(
            project=self._project,
            group=str(metadata["run_id"]),
            name=str(metadata["peer_id"]),
            config=metadata,
            mode=wandb_mode(os.environ),  # type: ignore[arg-type]
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        if self._run is not None:
            self._run.log({f"round/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


def wandb_mode(environ: dict[str, str] | os._Environ[str]) -> str:
    """WANDB_MODE if set; online with an API key (env or ~/.netrc login); else offline."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    netrc = Path(environ.get("HOME", "~")).expanduser() / ".netrc"
    logged_in = netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="replace")
    return "online" if environ.get("WANDB_API_KEY") or logged_in else "offline"


def tracked(events: EventLog, config: JoinConfig) -> EventLog:
    """`events`, with tracking in front of it when --tensorboard or --wandb asks for it."""
    sinks: list[MetricSink] = []
    if config.tensorboard:
        sinks.append(TensorBoardSink(Path(config.tensorboard).expanduser()))
    if config.wandb:
        sinks.append(WandbSink(project="diloco-node"))
    return TrackedEventLog(events, sinks, config.org) if sinks else events
