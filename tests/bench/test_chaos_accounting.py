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


def _first_batch(t: float) -> dict:
    return {"event": "startup_phase", "name": "first_batch", "time": t}


def _saved(t: float, round_: int, step: int, copied_at: float) -> dict:
    return {"event": "checkpoint_saved", "time": t, "round": round_, "step": step,
            "background": True, "copied_at": copied_at}  # fmt: skip


def test_time_not_computing_is_downtime_start_up_lost_steps_and_the_rest() -> None:
    # Killed at 20: it had published a round at 15 and copied round 2 at step 3 at 18; the
    # restart (launched at 30) resumes that copy and steps at 35. Killed again at 50 with no
    # save since its round ended at 46: the next one resumes nothing.
    first = Incarnation(
        [started(0, "A"), _first_batch(1), round_done(15), _saved(18.5, 1, 3, 18.0)],
        0.0,
        ended=20.0,
        killed=True,
    )
    resumed = {"event": "resumed", "time": 34, "round": 1, "step": 3}
    second = Incarnation(
        [resumed, _first_batch(35), started(35, "A"), round_done(46)], 30.0, ended=50.0, killed=True
    )
    stale = {"event": "resumed", "time": 64, "round": 2, "step": 0, "stale_partial_step": 4}
    third = Incarnation([stale, _first_batch(66), started(66, "A")], 60.0)
    a = Slot(0, [first, second, third])
    breakdown = account([a], 0.0, 100.0, synchronous=False, window_s=5.0)["time_breakdown"]
    assert breakdown["downtime_s"] == 20.0  # 20 to 30, 50 to 60
    assert breakdown["startup_each_s"] == [5.0, 6.0] and breakdown["startup_s"] == 11.0
    assert breakdown["lost_each_s"] == [2.0, 4.0]  # since the copy at 18; since 46
    compute = 2 * 4.0  # the rounds that ended at 15 and 46
    assert breakdown["other_s"] == 100.0 - compute - 20.0 - 11.0 - 6.0


def test_a_restart_killed_before_it_loaded_the_checkpoint_does_not_hide_what_was_kept() -> None:
    first = Incarnation(
        [started(0, "A"), _first_batch(1), round_done(15), _saved(18.5, 1, 3, 18.0)],
        0.0,
        ended=20.0,
        killed=True,
    )
    silent = Incarnation([], 30.0, ended=35.0, killed=True)  # still importing
    resumed = {"event": "resumed", "time": 48, "round": 1, "step": 3}
    third = Incarnation([resumed, _first_batch(50), started(50, "A")], 45.0)
    breakdown = account([Slot(0, [first, silent, third])], 0.0, 100.0, synchronous=False,
                        window_s=5.0)["time_breakdown"]  # fmt: skip
    assert breakdown["lost_each_s"] == [2.0, 0.0]
    assert breakdown["startup_each_s"] == [5.0, 5.0]  # the silent one: launch to its kill


def test_only_time_inside_the_steps_is_compute_and_the_first_step_is_not_start_up() -> None:
    # Launched at 0, its first step (1 s of compute) ended at 3; its round's inner_s of 8 s
    # holds 6 s inside steps and 2 s of the loop's own work between them (the DHT's fork).
    first_step = {"event": "startup_phase", "name": "first_batch", "time": 3.0, "step_s": 1.0}
    done = round_done(11.0, inner_s=8.0) | {"steps_s": 6.0}
    killed = Incarnation([started(0, "A")], -5.0, ended=-1.0, killed=True)
    node = Incarnation([first_step, started(2, "A"), merged(11, "A", 1), done], 0.0)
    peer = Slot(1, [Incarnation([started(0, "B"), merged(12, "A", 1)], 0.0)])
    figures = account([Slot(0, [killed, node]), peer], 0.0, 20.0, synchronous=False, window_s=5)
    (node_a, _) = figures["per_node"]
    assert node_a["compute_s"] == node_a["merged_any_s"] == 6.0
    breakdown = figures["time_breakdown"]
    assert breakdown["startup_each_s"] == [2.0]  # to the first step's start, not its end
    assert breakdown["loop_s"] == 2.0
    assert breakdown["other_s"] == 2 * 20.0 - 6.0 - 2.0 - 2.0


def test_a_save_on_disk_whose_event_never_came_out_counts_from_its_copy() -> None:
    # Killed at 20 after its save of round 2 at step 3 (copied at 18) was renamed into place
    # but before its event was printed: the restart's `resumed` carries the copy time.
    first = Incarnation(
        [started(0, "A"), _first_batch(1), round_done(15)], 0.0, ended=20.0, killed=True
    )
    resumed = {"event": "resumed", "time": 34, "round": 1, "step": 3, "copied_at": 18.0}
    second = Incarnation([resumed, _first_batch(35), started(35, "A")], 30.0)
    breakdown = account([Slot(0, [first, second])], 0.0, 100.0, synchronous=False,
                        window_s=5.0)["time_breakdown"]  # fmt: skip
    assert breakdown["lost_each_s"] == [2.0]  # not 5.0, since the round's end at 15
    # A copy older than the killed incarnation: none of its steps was kept.
    older = {**resumed, "copied_at": -3.0}
    again = Incarnation([older, _first_batch(35), started(35, "A")], 30.0)
    breakdown = account([Slot(0, [first, again])], 0.0, 100.0, synchronous=False,
                        window_s=5.0)["time_breakdown"]  # fmt: skip
    assert breakdown["lost_each_s"] == [5.0]


def test_a_round_set_aside_counts_where_its_steps_ran_and_a_kill_after_it_from_its_end() -> None:
    # Round 1's steps ran 2 to 6 (inner_s 4, steps_s 3); it waited aside 5 s while round 2
    # trained and was published at 12 (round_s 5: its steps and publication, not the wait).
    # Killed at 14 with round 2's steps since 6 not saved (the restart dropped the save
    # aside as published since): lost from round 1's end at 6, not its publication at 12.
    aside = round_done(12.0, inner_s=4.0) | {"steps_s": 3.0, "round_s": 5.0, "aside_s": 5.0}
    first = Incarnation(
        [started(0, "A"), _first_batch(2), merged(12, "A", 1), aside], 0.0, ended=14.0, killed=True
    )
    stale = {"event": "resumed", "time": 30, "round": 1, "step": 0, "stale_partial_step": 3}
    second = Incarnation([stale, _first_batch(31), started(31, "A")], 24.0)
    peer = Slot(1, [Incarnation([started(0, "B"), merged(12.5, "A", 1)], 0.0)])
    # A window opening at 5 holds 1 s of round 1's inner steps (5 to 6), not 4 (8 to 12).
    figures = account([Slot(0, [first, second]), peer], 5.0, 40.0, synchronous=False,
                      window_s=5.0)  # fmt: skip
    node_a = figures["per_node"][0]
    assert node_a["compute_s"] == node_a["merged_any_s"] == 0.75
    assert figures["time_breakdown"]["lost_each_s"] == [8.0]
