"""Goodput accounting from node events, on hand-made event streams."""

from __future__ import annotations

from bench.chaos_accounting import Incarnation, Slot, account


def merged(t: float, author: str, seq: int) -> dict:
    return {"event": "update_merged", "time": t, "author": author, "seq": seq}


def round_done(t: float, inner_s: float = 4.0) -> dict:
    return {"event": "round_done", "time": t, "inner_s": inner_s, "round_s": inner_s + 1.0}


def started(t: float, peer: str) -> dict:
    return {"event": "started", "time": t, "peer_id": peer}


def test_async_compute_counts_once_a_peer_merged_it() -> None:
    a = Slot(
        0,
        [
            Incarnation(
                [
                    started(0, "A"),
                    merged(5, "A", 1),
                    round_done(5),
                    merged(10, "A", 2),
                    round_done(10),
                ],
                0.0,
            )
        ],
    )
    b = Slot(1, [Incarnation([started(0, "B"), merged(6, "A", 1)], 0.0)])
    figures = account([a, b], 0.0, 10.0, synchronous=False, window_s=5.0)
    node_a = figures["per_node"][0]
    assert node_a["compute_s"] == 8.0
    assert node_a["merged_any_s"] == 4.0  # seq 2 was never merged by B
    assert node_a["updates_published"] == 2 and node_a["updates_lost"] == 1
    assert figures["goodput"] == 4.0 / 20.0
    assert figures["uptime"] == 0.5  # B merged in the second window only


def test_a_killed_node_is_not_a_live_peer_for_all_live_merges() -> None:
    a = Slot(0, [Incarnation([started(0, "A"), merged(5, "A", 1), round_done(5)], 0.0)])
    b = Slot(1, [Incarnation([started(0, "B"), merged(6, "A", 1)], 0.0)])
    c = Slot(2, [Incarnation([started(0, "C")], 0.0, ended=7.0, killed=True)])
    figures = account([a, b, c], 0.0, 10.0, synchronous=False, window_s=5.0)
    assert figures["per_node"][0]["merged_all_s"] == 4.0
    assert figures["restarts"] == 1


def test_a_synchronous_round_counts_when_its_all_reduce_committed() -> None:
    def sync_round(t: float, committed: bool, group: int) -> dict:
        return round_done(t) | {"committed": committed, "group_size": group}

    a = Slot(
        0, [Incarnation([started(0, "A"), sync_round(5, True, 2), sync_round(10, False, 0)], 0.0)]
    )
    b = Slot(1, [Incarnation([started(0, "B"), sync_round(5, True, 2)], 0.0)])
    figures = account([a, b], 0.0, 10.0, synchronous=True, window_s=5.0)
    assert figures["per_node"][0]["merged_any_s"] == 4.0
    assert figures["per_node"][0]["merged_all_s"] == 4.0
    assert figures["updates_lost"] == 1


def test_an_update_inside_a_downloaded_state_counts_as_merged_by_the_downloader() -> None:
    # A merged seqs 1 and 2 while B was down; B restarted and downloaded A's replica.
    a = Slot(
        0,
        [
            Incarnation(
                [started(0, "A"), merged(4, "A", 1), round_done(4), merged(8, "A", 2)]
                + [round_done(8)],
                0.0,
            )
        ],
    )
    download = {"event": "state_downloaded", "time": 9, "applied_runs": {"A": [[1, 2]]}}
    b = Slot(1, [Incarnation([started(9, "B"), download], 0.0)])
    figures = account([a, b], 0.0, 10.0, synchronous=False, window_s=5.0)
    node_a = figures["per_node"][0]
    assert node_a["merged_any_s"] == node_a["compute_s"] == 7.0  # 3 s of round 1 in the window
    assert figures["updates_lost"] == 0
