"""Which run `join --peers M` without --run-id joins, from the run records peers hold."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.cli import build_parser
from node.run_choice import (
    ADOPTABLE,
    RunChoiceError,
    SwarmRun,
    choose_run,
    run_id_given,
    swarm_run,
)
from node.settings_cli import flag_value


def _summary(**settings: object) -> str:
    return json.dumps({"model": "tiny", "settings": settings})


def test_a_swarm_with_no_run_yet_leaves_the_node_its_own() -> None:
    assert choose_run([]) is None


def test_the_only_run_is_joined_with_its_settings_and_the_users_flags_win() -> None:
    run = choose_run(
        [swarm_run("their-run", [_summary(run_id="their-run", model="tiny", inner_steps=5)])]
    )
    assert run is not None and run.describe() == "'their-run' (--model tiny --inner-steps 5)"
    argv = ["join", *run.join_flags(), "--peers", "/ip4/1.2.3.4/tcp/1/p2p/x", "--inner-steps", "7"]
    args = build_parser().parse_args(argv)
    chosen = [flag_value(args, name) for name in ("run_id", "model", "inner_steps")]
    assert chosen == ["their-run", "tiny", 7]


def test_several_runs_stop_the_node_with_one_line_listing_them() -> None:
    runs = [
        swarm_run("beta", [_summary(run_id="beta", model="small")]),
        swarm_run("alpha", [_summary(run_id="alpha", model="tiny", codec="int8")]),
    ]
    with pytest.raises(RunChoiceError) as error:
        choose_run(runs)
    assert str(error.value) == (
        "the swarm trains 2 runs: 'alpha' (--model tiny --codec int8), 'beta' (--model small); "
        "choose one with --run-id RUN (or paste the join command its nodes print)"
    )


@pytest.mark.parametrize(
    "summaries",
    [
        ["not json"],
        [_summary(run_id="r", model="--data")],  # a value posing as a flag
        [_summary(run_id="someone-else", model="tiny")],  # a record filed under another run
        [_summary(run_id="r", model="tiny"), _summary(run_id="r", model="small")],  # two configs
    ],
)
def test_a_run_whose_settings_cannot_be_trusted_is_not_adopted(summaries: list[str]) -> None:
    run = swarm_run("r", summaries)
    assert run.settings is None
    with pytest.raises(RunChoiceError, match="paste the join command its nodes print"):
        choose_run([run])


def test_a_peer_cannot_set_where_the_node_reads_writes_or_when_it_stops() -> None:
    hostile = _summary(
        run_id="r", model="tiny", data="/etc", checkpoint_dir="/", identity="/tmp/k",
        max_rounds=1, device="cuda", allow_keys="/x", peers="/ip4/6.6.6.6/tcp/1",
    )  # fmt: skip
    assert swarm_run("r", [hostile]).settings == {"run_id": "r", "model": "tiny"}


_NAMES = st.one_of(
    st.sampled_from(sorted(ADOPTABLE | {"data", "identity", "checkpoint_dir", "peers"})),
    st.text(max_size=20),
)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(_NAMES, st.one_of(st.text(), st.integers(), st.none())))
def test_any_record_gives_only_adoptable_plain_settings(record: dict[str, object]) -> None:
    run = swarm_run("r", [json.dumps({"settings": record})])
    if run.settings is not None:
        assert set(run.settings) <= ADOPTABLE | {"run_id"}
        assert all(not str(flag).startswith("--") for flag in run.join_flags()[1::2][1:])


def test_the_run_is_named_with_either_spelling_of_the_flag() -> None:
    assert run_id_given(["--peers", "M", "--run-id", "x"])
    assert run_id_given(["--run-id=x"])
    assert not run_id_given(["--peers", "M", "--model", "tiny"])
    assert SwarmRun("x", {}).join_flags() == ["--run-id", "x"]
