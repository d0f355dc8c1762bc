"""node.allocator: glibc's malloc bounded at a node's start (where glibc runs), glibc's own
environment left to the operator, and a clear refusal of a bad DILOCO_MALLOC."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from node import allocator
from node.allocator import AllocatorConfig, bound_allocator, config_from_env, glibc, parse_spec

ON_GLIBC = pytest.mark.skipif(glibc() is None, reason="glibc only (this machine's C library)")

# In a child process: mallopt and the trimmer are process-wide, not this test run's to change.
# A freed 4 MiB buffer raises glibc's dynamic mmap threshold to 4 MiB; a 1 MiB buffer is then
# mmapped (mallinfo2's hblkhd) only if the threshold was fixed below it.
CHILD = """
import ctypes, json, os, sys, time
from node.allocator import bounded_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
with bounded_allocator(os.environ) as bound:
    big = bytearray(4 << 20)
    del big
    before = libc.mallinfo2().hblkhd
    kept = bytearray(1 << 20)
    mmapped = libc.mallinfo2().hblkhd - before
    time.sleep(0.25)
print(json.dumps({"mmapped": mmapped, **bound.fields(), **bound.trims.fields()}))
"""


def child(spec: str) -> dict[str, object]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), "DILOCO_MALLOC": spec}
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


@ON_GLIBC
def test_it_applies_on_this_machine_and_megabyte_buffers_are_mmapped() -> None:
    default = child("trim_period_s=0.05")
    assert default["libc"], "glibc is reported"
    assert default["applied"] == {"arena_max": 2, "trim_period_s": 0.05}
    assert default["num_trims"] >= 1 and default["skipped"] is None
    bounded = child(f"trim_period_s=0.05,mmap_threshold_bytes={512 << 10}")
    assert bounded["applied"] == {
        "arena_max": 2, "mmap_threshold_bytes": 512 << 10, "trim_period_s": 0.05,
    }  # fmt: skip
    assert bounded["mmapped"] >= 1 << 20, "a 1 MiB buffer is mmapped, so freeing it unmaps it"
    assert bounded["num_trims"] >= 1 and bounded["skipped"] is None
    plain = child("glibc")
    assert plain["applied"] == {} and plain["num_trims"] == 0
    assert plain["mmapped"] == 0, "glibc's dynamic threshold keeps it in an arena"


def test_elsewhere_nothing_is_set_and_the_report_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    bound = bound_allocator(AllocatorConfig())
    assert bound.applied == {} and bound.libc is None
    assert "not glibc (darwin)" in str(bound.skipped)


def test_a_spec_sets_some_settings_and_0_turns_one_off() -> None:
    assert parse_spec("") == AllocatorConfig()
    assert parse_spec("glibc") == AllocatorConfig(
        arena_max=None, mmap_threshold_bytes=None, trim_period_s=None
    )
    spec = parse_spec(" arena_max=4, trim_period_s=0 ")
    assert spec == AllocatorConfig(arena_max=4, trim_period_s=None)
    for bad, says in [
        ("arenas=2", "is not one of"),
        ("arena_max=", "is not one of"),
        ("arena_max=two", "is not a number"),
        ("arena_max=-1", "arena_max must be >= 1"),
        ("mmap_threshold_bytes=99999999999", "1 to 32 MiB"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_spec(bad)


def test_glibc_settings_in_the_environment_are_the_operators() -> None:
    config, left = config_from_env({"MALLOC_ARENA_MAX": "4"})
    assert config == AllocatorConfig(arena_max=None) and left == ["MALLOC_ARENA_MAX"]
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536", "DILOCO_MALLOC": "glibc"}
    config, left = config_from_env(tunables)
    assert config.mmap_threshold_bytes is None and left == ["glibc.malloc.mmap_threshold"]
    assert config_from_env({}) == (AllocatorConfig(), [])
