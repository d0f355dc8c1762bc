"""What a node tells its operator: JSON lines for machines, a live progress line for people."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from node.round_eta import RoundEta, format_duration

if TYPE_CHECKING:  # rich is imported by the console's log only: not on a JSON node's start
    from rich.console import Console
    from rich.live import Live


class EventLog(Protocol):
    def emit(self, event: str, **fields: Any) -> None: ...

    def progress(self, **fields: Any) -> None: ...

    def close(self) -> None: ...


class JsonEventLog:
    """One JSON object per line on stdout, each with an `event` field and a unix `time`."""

    PROGRESS_PERIOD_S = 5.0
    """At most one `progress` event per this many seconds (the first step of a run at once)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()
        self._last_progress = -float("inf")

    def emit(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "time": round(time.time(), 3), **fields}, default=str)
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()

    def progress(self, **fields: Any) -> None:
        """Per-step progress, thinned out: a long round still shows it is moving."""
        now = time.monotonic()
        if now - self._last_progress >= self.PROGRESS_PERIOD_S:
            self._last_progress = now
            self.emit("progress", **fields)

    def close(self) -> None:
        self._stream.flush()


class RecordingEventLog:
    """Keeps every event in memory (benchmarks and tests read them back)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        with self._lock:
            self.events.append({"event": event, **fields})

    def progress(self, **fields: Any) -> None:
        """Per-step progress is not recorded."""

    def close(self) -> None:
        """Nothing to release."""

    def of(self, event: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e["event"] == event]


class ConsoleEventLog:
    """Progress within the round (step, loss, tokens/s, ETA) plus one line per notable event.

    On a terminal the progress is a live status line; into a file or journald it is a
    printed line every PROGRESS_PERIOD_S seconds (a live bar would write nothing there).
    """

    PROGRESS_PERIOD_S = 5.0

    def __init__(self, console: Console | None = None) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        self._console = console or Console(stderr=True)
        self._live: Live | None = None
        if self._console.is_terminal:
            self._live = Live(Text(""), console=self._console, refresh_per_second=4, transient=True)
            self._live.start()
        self._eta = RoundEta()
        self._last_printed_s = -float("inf")

    def emit(self, event: str, **fields: Any) -> None:
        text = _describe(event, fields)
        if text:
            self._console.print(text, highlight=False, soft_wrap=True)

    def progress(self, **fields: Any) -> None:
        now_s = time.monotonic()
        line = _progress_line(
            fields,
            self._eta.estimate(fields["round"], fields["step"], fields["inner_steps"], now_s),
        )
        if self._live is not None:
            from rich.text import Text

            self._live.update(Text(line, style="cyan"))
        elif now_s - self._last_printed_s >= self.PROGRESS_PERIOD_S:
            self._last_printed_s = now_s
            self._console.print(line, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()


def _progress_line(f: dict[str, Any], eta_s: float | None) -> str:
    eta = f"  ETA {format_duration(eta_s)}" if eta_s is not None else ""
    return (
        f"round {f['round']}  step {f['step']}/{f['inner_steps']}  loss {f['loss']:.4f}  "
        f"{f['tokens_per_s']:,.0f} tok/s{eta}"
    )


def _describe(event: str, f: dict[str, Any]) -> str | None:
    if event == "started":
        return (
            f"[bold]diloco-node[/] {f['peer_id']} run '{f['run_id']}' "
            f"({f['model']}, {f['num_params']:,} params, {f['device']}); "
            f"data: {f['data']}"
        )
    if event == "evaluated":
        return f"val loss at round {f['round']}: {f['val_loss']:.4f}"
    if event == "listening":
        addresses = "\n  ".join(f["maddrs"])
        return f"listening on\n  {addresses}\nothers join with:\n  [bold]{f['join_command']}[/]"
    if event == "state_progress":
        return f"downloading the replica from {f['peer_id']}: {f['line']}"
    if event == "reachability":
        return f"reachability: {f['line']}"
    if event == "dashboard":
        return f"dashboard: [bold]{f['url']}[/] ({f['access']}; --no-dashboard for none)"
    if event == "state_downloaded":
        return (
            f"downloaded the replica ({f['num_applied']} updates, {f['megabytes']:.1f} MB, "
            f"{f['mb_per_s']:.0f} MB/s) from {f['peer_id']}"
        )
    if event in ("peer_joined", "peer_left"):
        return f"peer {f['peer_id']} {'joined' if event == 'peer_joined' else 'left'}"
    if event == "resumed":
        return f"resumed from {f['path']}: {_resumed_at(f)} ({f['num_applied']} updates merged)"
    if event == "round_done":
        val = f"  val {f['val_loss']:.4f}" if f.get("val_loss") is not None else ""
        return (
            f"round {f['round']:>4}  loss {f['loss']:.4f}{val}  "
            f"{f['tokens_per_s']:,.0f} tok/s  merged {f['num_applied']}"
        )
    if event == "update_rejected":
        return f"[yellow]rejected update from {f['author']}: {f['reason']}[/]"
    if event == "checkpoint_moved":
        return f"moved this node's checkpoint from {f['src']} to {f['path']}"
    if event == "checkpoint_saved":
        if f.get("background"):
            return None  # every few seconds mid-round: kept in the JSON log, not on the console
        partial = f" (round {f['round'] + 1} kept at step {f['step']})" if f.get("step") else ""
        return f"checkpoint saved to {f['path']}{partial}"
    if event == "stopped":
        return f"stopped after {f['round']} rounds ({f['reason']})"
    return None


def _resumed_at(f: dict[str, Any]) -> str:
    """`round` counts the rounds done; `step`, when set, the steps done of the next one."""
    done = f"{f['round']} round{'s' if f['round'] != 1 else ''} done"
    if f.get("step"):
        return f"{done}, round {f['round'] + 1} continues after its step {f['step']}"
    return f"{done}, round {f['round'] + 1} starts afresh"


def make_event_log(log_format: str) -> EventLog:
    return JsonEventLog() if log_format == "json" else ConsoleEventLog()


def configure_logging(level: str, log_format: str) -> None:
    """Library logs go to stderr; with JSON events on stdout the two never mix."""
    handler: logging.Handler
    if log_format == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(console=Console(stderr=True), show_path=False)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
