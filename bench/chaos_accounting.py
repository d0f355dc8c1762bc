"""Goodput accounting of a chaos run, from the JSON events the nodes printed. No processes here.

Per node slot (one slot is one machine; a restart is a new incarnation in the same slot):
- allocated seconds: the measured window, whether the node was up or not;
- compute seconds: time inside the inner steps of its rounds in the window (`round_done`'s
  `steps_s`; a round straddling an edge counts for its part inside). The loop's own work
  between steps (partial saves' copies, the DHT's fork, starting what runs beside training:
  `inner_s` - `steps_s`) is not compute: `time_breakdown`'s `loop_s`. Events without
  `steps_s` (synchronous workers, nodes before it) count their `inner_s`;
- merged seconds: compute of rounds whose update was merged by at least one other node (or came
  to it inside a state it downloaded), and by all live others (those up when it was published
  and still up, never killed, at the end);
- restarts, updates published and updates lost (never merged by any other node);
- where the allocated time went that was not compute (`time_breakdown`): downtime (kill to
  relaunch), start-up (launch to the first inner step's start: `startup_phase` `first_batch`
  less that step's own `step_s`, which is compute), inner steps lost at a kill (from the
  state it kept: the partial round the next incarnation resumed, copied at
  `checkpoint_saved`'s `copied_at`, else the end of its last round's steps), the loop's work
  between steps (`loop_s`) and the rest (between rounds: publishing, merging, waiting for the
  swarm). A round set aside while the swarm was not entered (`round_done`'s `aside_s`: the
  next round trained meanwhile) is placed where its steps ran, not where it was published.
Asynchronous nodes (`diloco-node join`) and synchronous workers (`bench.sync_baseline`) are
accounted alike; for a synchronous worker, "merged" means its round's all-reduce committed, with
at least one other worker, or with every live worker.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]


@dataclass
class Incarnation:
    """One process of a node slot, from launch to exit."""

    events: list[Event]
    launched: float
    ended: float | None = None
    killed: bool = False

    @property
    def started(self) -> float | None:
        """When it began training (its `started` event), if it got that far."""
        return next((e["time"] for e in self.events if e.get("event") == "started"), None)

    @property
    def peer_id(self) -> str | None:
        return next((e["peer_id"] for e in self.events if "peer_id" in e), None)

    def up_at(self, t: float) -> bool:
        started = self.started
        return started is not None and started <= t and (self.ended is None or t < self.ended)


@dataclass
class Slot:
    node: int
    incarnations: list[Incarnation] = field(default_factory=list)

    @property
    def restarts(self) -> int:
        return sum(i.killed for i in self.incarnations)

    def survives_from(self, t: float) -> bool:
        """Up at `t` and never killed after it."""
        return any(i.up_at(t) and not i.killed for i in self.incarnations)


@dataclass(frozen=True)
class Round:
    node: int
    end: float
    inner_s: float
    round_s: float
    seq: int | None
    """Async: the seq of the node's own update published by this round."""
    group_size: int = 0
    """Sync: workers in the round's all-reduce (0: it failed)."""
    committed: bool = False
    steps_s: float | None = None
    """Of inner_s, the time inside the inner steps (None: not reported, all of inner_s)."""
    aside_s: float = 0.0
    """Seconds the finished round waited, set aside, for the swarm while the next round
    trained: between its steps' end and its publication, not in round_s."""


def async_rounds(slot: Slot) -> list[Round]:
    """Each round_done paired with the node's own update_merged that precedes it."""
    rounds = []
    for inc in slot.incarnations:
        own, seq = inc.peer_id, None
        for e in inc.events:
            if e.get("event") == "update_merged" and e["author"] == own:
                seq = int(e["seq"])
            elif e.get("event") == "round_done":
                steps_s, aside_s = e.get("steps_s"), float(e.get("aside_s") or 0.0)
                rounds.append(
                    Round(
                        slot.node,
                        e["time"],
                        e["inner_s"],
                        e["round_s"],
                        seq,
                        steps_s=steps_s,
                        aside_s=aside_s,
                    )
                )
                seq = None
    return rounds


def sync_rounds(slot: Slot) -> list[Round]:
    return [
        Round(
            slot.node, e["time"], e["inner_s"], e["round_s"], None, e["group_size"], e["committed"]
        )
        for inc in slot.incarnations
        for e in inc.events
        if e.get("event") == "round_done"
    ]


def inner_in_window(r: Round, t0: float, t1: float) -> float:
    """The part of the round's inner steps (they open the round) inside [t0, t1]."""
    start = r.end - r.round_s - r.aside_s
    return max(0.0, min(start + r.inner_s, t1) - max(start, t0))


def steps_in_window(r: Round, t0: float, t1: float) -> float:
    """Of `inner_in_window`, the time inside the steps themselves (in proportion)."""
    inner = inner_in_window(r, t0, t1)
    if r.steps_s is None or r.inner_s <= 0:
        return inner
    return inner * min(1.0, max(0.0, r.steps_s) / r.inner_s)


def merged_by(slots: list[Slot]) -> dict[tuple[str, int], set[int]]:
    """(author, seq) -> slots that merged it as a peer's update, or took it in with a state
    they downloaded (a restarted node downloads the replica that holds it)."""
    found: dict[tuple[str, int], set[int]] = defaultdict(set)
    for slot in slots:
        for inc in slot.incarnations:
            for e in inc.events:
                if e.get("event") == "update_merged" and e["author"] != inc.peer_id:
                    found[(e["author"], int(e["seq"]))].add(slot.node)
                elif e.get("event") == "state_downloaded":
                    for author, seq in downloaded(e, inc.peer_id):
                        found[(author, seq)].add(slot.node)
    return found


def downloaded(event: Event, own: str | None) -> list[tuple[str, int]]:
    """Peers' update ids a `state_downloaded` event's state held (its `applied_runs`)."""
    runs: dict[str, list[list[int]]] = event.get("applied_runs") or {}
    return [
        (author, seq)
        for author, author_runs in runs.items()
        if author != own
        for first, last in author_runs
        for seq in range(int(first), int(last) + 1)
    ]


def account(slots: list[Slot], t0: float, t1: float, *, synchronous: bool, window_s: float) -> dict:
    """Per-node figures and the totals: goodput, uptime, updates lost."""
    merged = {} if synchronous else merged_by(slots)
    per_node = []
    for slot in slots:
        authors = {i.peer_id for i in slot.incarnations}
        rounds = sync_rounds(slot) if synchronous else async_rounds(slot)
        rounds = [r for r in rounds if inner_in_window(r, t0, t1) > 0 or t0 <= r.end <= t1]
        others = [s for s in slots if s is not slot]
        figures = {"node": slot.node, "allocated_s": t1 - t0, "restarts": slot.restarts}
        figures |= _round_figures(rounds, others, merged, authors, t0, t1, synchronous)
        per_node.append(figures)
    totals = _totals(per_node)
    return totals | {
        "uptime": uptime(slots, t0, t1, window_s, synchronous=synchronous),
        "time_breakdown": time_breakdown(slots, t0, t1, totals["compute_s"], totals["loop_s"]),
        "per_node": per_node,
    }


def time_breakdown(
    slots: list[Slot], t0: float, t1: float, compute_s: float, loop_s: float = 0.0
) -> dict:
    """Allocated node-seconds that were not compute, by cause; each restart's start-up and
    each kill's lost inner steps, in the window's order. `loop_s`: the rounds' work between
    their steps (inside inner_s, not compute)."""
    downtime = startup = lost = 0.0
    startups: list[float] = []
    losses: list[float] = []
    for slot in slots:
        incarnations = slot.incarnations
        for k, inc in enumerate(incarnations):
            nxt = incarnations[k + 1] if k + 1 < len(incarnations) else None
            if k > 0 and t0 <= inc.launched < t1:
                first = first_step_started_at(inc)
                end = min(t1, first if first is not None else (inc.ended or t1))
                startup += max(0.0, end - inc.launched)
                startups.append(round(end - inc.launched, 2))
            if inc.killed and inc.ended is not None and t0 <= inc.ended < t1:
                relaunch = nxt.launched if nxt is not None else t1
                downtime += max(0.0, min(relaunch, t1) - inc.ended)
                lost_s = lost_at_kill(inc, incarnations[k + 1 :])
                lost += lost_s
                losses.append(round(lost_s, 2))
    allocated = len(slots) * (t1 - t0)
    return {
        "downtime_s": round(downtime, 2),
        "startup_s": round(startup, 2),
        "lost_at_kill_s": round(lost, 2),
        "loop_s": round(loop_s, 2),
        "other_s": round(allocated - compute_s - downtime - startup - lost - loop_s, 2),
        "startup_each_s": startups,
        "lost_each_s": losses,
    }


def first_step_at(inc: Incarnation) -> float | None:
    """When the incarnation's first inner step ended."""
    event = _first_batch(inc)
    return None if event is None else event["time"]


def first_step_started_at(inc: Incarnation) -> float | None:
    """When its first inner step began: the start-up ends there (the step is compute)."""
    event = _first_batch(inc)
    return None if event is None else event["time"] - float(event.get("step_s") or 0.0)


def _first_batch(inc: Incarnation) -> Event | None:
    return next(
        (
            e
            for e in inc.events
            if e.get("event") == "startup_phase" and e.get("name") == "first_batch"
        ),
        None,
    )


def lost_at_kill(killed: Incarnation, later: list[Incarnation]) -> float:
    """Seconds of inner steps a kill lost: since the state the next incarnation to load one
    resumed (its partial round's copy; one killed before it loaded its checkpoint does not
    count) or, if it resumed none, since the killed one's last round ended (0 if it never
    stepped)."""
    assert killed.ended is not None
    events = (e for inc in later for e in inc.events)
    resumed = next((e for e in events if e.get("event") == "resumed"), None)
    kept: float | None = None
    copied_at = resumed.get("copied_at") if resumed is not None else None
    if resumed is not None and resumed.get("step") and isinstance(copied_at, int | float):
        # The checkpoint's own copy time: also when the killed one wrote it but died before
        # its `checkpoint_saved` event was out. Copied by an earlier incarnation: nothing
        # of the killed one's steps was kept.
        if killed.launched <= copied_at <= killed.ended:
            kept = copied_at
    elif resumed is not None and resumed.get("step"):
        saves = [
            e
            for e in killed.events
            if e.get("event") == "checkpoint_saved"
            and (e.get("round"), e.get("step")) == (resumed["round"], resumed["step"])
        ]
        kept = saves[-1].get("copied_at", saves[-1]["time"]) if saves else None
    if kept is None:
        ends = [_next_round_from(e) for e in killed.events if e.get("event") == "round_done"]
        kept = max(ends) if ends else first_step_at(killed)
    return 0.0 if kept is None else max(0.0, killed.ended - kept)


def _next_round_from(done: Event) -> float:
    """When the round after a `round_done` began: at its publication, or for a round set
    aside (`aside_s`), at the end of its steps (its wait and publication ran beside it)."""
    aside = float(done.get("aside_s") or 0.0)
    if not aside:
        return float(done["time"])
    return float(done["time"]) - done["round_s"] - aside + done["inner_s"]


Merged = dict[tuple[str, int], set[int]]


def _round_figures(
    rounds: list[Round],
    others: list[Slot],
    merged: Merged,
    authors: set[str | None],
    t0: float,
    t1: float,
    synchronous: bool,
) -> dict[str, float]:
    compute = any_s = all_s = loop = 0.0
    published = lost = 0
    for r in rounds:
        inner = steps_in_window(r, t0, t1)
        loop += inner_in_window(r, t0, t1) - inner
        compute += inner
        status = (
            _sync_status(r, others) if synchronous else _async_status(r, others, merged, authors)
        )
        if status is None:
            continue  # no update came out of this round
        by_any, by_all = status
        published += 1
        lost += not by_any
        any_s += inner if by_any else 0.0
        all_s += inner if by_all else 0.0
    return {
        "compute_s": compute,
        "loop_s": loop,
        "merged_any_s": any_s,
        "merged_all_s": all_s,
        "updates_published": published,
        "updates_lost": lost,
    }


def _sync_status(r: Round, others: list[Slot]) -> tuple[bool, bool]:
    """(merged by another worker, merged by every live worker): the all-reduce committed."""
    live = 1 + sum(_up(s, r.end) for s in others)
    return r.committed, r.committed and r.group_size >= live


def _async_status(
    r: Round, others: list[Slot], merged: Merged, authors: set[str | None]
) -> tuple[bool, bool] | None:
    """(merged by another node, merged by every other node live from then to the end)."""
    if r.seq is None:
        return None
    mergers: set[int] = set()
    for author in authors:
        if author is not None:
            mergers |= merged.get((author, r.seq), set())
    live = {s.node for s in others if s.survives_from(r.end)}
    return bool(mergers), bool(mergers) and live <= mergers


def _up(slot: Slot, t: float) -> bool:
    return any(i.up_at(t) for i in slot.incarnations)


def _totals(per_node: list[dict]) -> dict:
    keys = (
        "allocated_s",
        "compute_s",
        "loop_s",
        "merged_any_s",
        "merged_all_s",
        "restarts",
        "updates_published",
        "updates_lost",
    )
    totals = {k: sum(n[k] for n in per_node) for k in keys}
    allocated = max(totals["allocated_s"], 1e-9)
    return {
        "goodput": round(totals["merged_any_s"] / allocated, 4),
        "goodput_all_live": round(totals["merged_all_s"] / allocated, 4),
        "compute_share": round(totals["compute_s"] / allocated, 4),
        **{k: round(v, 2) if isinstance(v, float) else v for k, v in totals.items()},
    }


def uptime(slots: list[Slot], t0: float, t1: float, window_s: float, *, synchronous: bool) -> float:
    """Share of windows of `window_s` in which the swarm merged at least one update."""
    num_windows = max(1, int((t1 - t0) // window_s))
    hits = set()
    for slot in slots:
        for inc in slot.incarnations:
            for e in inc.events:
                if _is_progress(e, inc.peer_id, synchronous) and t0 <= e["time"] < t1:
                    hits.add(int((e["time"] - t0) // window_s))
    return round(len([h for h in hits if h < num_windows]) / num_windows, 4)


def _is_progress(e: Event, own: str | None, synchronous: bool) -> bool:
    if synchronous:
        return e.get("event") == "round_done" and bool(e.get("committed"))
    return e.get("event") == "update_merged" and e.get("author") != own
