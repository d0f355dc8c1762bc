"""bench.slowlink's wiring: tbf on a namespace's link holds a real TCP transfer to its rate.

Needs root, iproute2 and tc (network namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from bench import netns
from bench.slowlink import SlowlinkConfig, add_ratios, not_run

LIMIT_MBIT = 8.0
PROBE_BYTES = 1_000_000
"""1 s of the limited link: long enough that tbf's 16 KiB bucket is a 2 % error."""

needs_netns = pytest.mark.skipif(
    not (netns.available() and shutil.which("tc")),
    reason="network namespaces need root, iproute2 and tc",
)


@needs_netns
def test_a_limited_link_carries_about_its_rate_each_way_and_an_unlimited_one_far_more() -> None:
    with netns.NetnsLab(2) as lab:
        unlimited = lab.measure_mbit(0, 1, 4 * PROBE_BYTES)
        lab.limit(0, LIMIT_MBIT)  # node 0 only: its sending and its receiving side
        assert "tbf" in lab.qdiscs(0) and "rate 8Mbit" in lab.qdiscs(0)
        sent = lab.measure_mbit(0, 1, PROBE_BYTES)
        received = lab.measure_mbit(1, 0, PROBE_BYTES)
        on_the_wire = lab.link_bytes(0)  # what tbf let through, headers included
    for rate in (sent, received):  # TCP/IP headers take ~3 % of the line rate
        assert 0.8 * LIMIT_MBIT <= rate <= 1.05 * LIMIT_MBIT, (sent, received)
    assert unlimited > 10 * LIMIT_MBIT, unlimited
    assert all(PROBE_BYTES <= n <= 1.1 * PROBE_BYTES for n in on_the_wire), on_the_wire


@needs_netns
def test_namespaces_are_gone_after_the_lab_even_on_an_exception() -> None:
    with pytest.raises(RuntimeError), netns.NetnsLab(1) as lab:
        lab.limit(0, LIMIT_MBIT)
        lab.bridge_address()
        names = [lab.namespace(0), lab.hub]
        raise RuntimeError("interrupted")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names), listed


def test_ratios_are_against_bf16_with_whole_updates_and_unreached_rows_get_none() -> None:
    def row(codec: str, link_mbit: float | None, seconds: float | None) -> dict:
        return {"codec": codec, "fragments": 1, "link_mbit": link_mbit,
                "reached": seconds is not None, "time_to_target_s": seconds}  # fmt: skip

    rows = [
        row("bf16", None, 60.0),
        row("bf16", 2.0, 100.0),
        row("int8", 2.0, 50.0),
        row("sparse", 2.0, None),
        not_run("bf16", 4, "no --fragments"),
    ]
    add_ratios(rows)  # against limited bf16: the unlimited row is the reference, not the base
    assert [r["ratio_vs_bf16"] for r in rows] == [0.6, 1.0, 0.5, None, None]
    assert rows[4]["note"] == "not run: no --fragments"


def test_rows_that_reach_the_target_where_bf16_did_not_get_an_upper_bound() -> None:
    def row(codec: str, seconds: float | None, elapsed: float) -> dict:
        return {"codec": codec, "fragments": 1, "link_mbit": 2.0, "reached": seconds is not None,
                "time_to_target_s": seconds, "elapsed_s": elapsed}  # fmt: skip

    rows = [row("bf16", None, 240.0), row("sparse", 60.0, 60.0), row("int8", None, 240.0)]
    add_ratios(rows)
    assert [r["ratio_vs_bf16"] for r in rows] == [None, None, None]
    assert [r.get("ratio_vs_bf16_below") for r in rows] == [None, 0.25, None]


def test_bad_settings_are_refused_with_one_clear_sentence() -> None:
    with pytest.raises(ValueError, match="--fragments takes counts"):
        SlowlinkConfig(fragments="1,four")
    with pytest.raises(ValueError, match="--link-mbit must be positive"):
        SlowlinkConfig(link_mbit=0)


def test_a_link_rate_out_of_range_is_refused_before_tc_runs() -> None:
    lab = netns.NetnsLab(1)  # not entered: no namespace is made
    with pytest.raises(ValueError, match="link rate"):
        lab.limit(0, 0.0)
