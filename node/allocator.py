"""The node process's allocator: glibc's malloc told to hand freed memory back to the system.

bench.attack (docs/bench-attack.md, flood8) found a flooded node's RSS 146 MB over a clean
run's, ~125 MB of it memory already freed that glibc kept in its arenas: every fetched update
(1.6 MB for `tiny`) is copied several times on the loop, the merge thread and `to_thread`
workers, each of which can hold an arena of its own (up to 8 per core), and glibc's dynamic
mmap threshold rises to the largest buffer freed (up to 32 MiB), after which megabyte
buffers come from the arenas instead of mmap and fragment them. At the start of `join`,
before the node's threads exist, this sets (AllocatorConfig; what a run measured is in
docs/bench-attack.md):

- M_ARENA_MAX: a few arenas, shared by every thread;
- M_MMAP_THRESHOLD (off by default: it slows CPU training, see AllocatorConfig): buffers this
  large and above are mmapped and unmapped on free (a fixed value also turns the dynamic
  threshold off);
- malloc_trim(0) on a daemon thread every `trim_period_s`: free pages inside the arenas go
  back to the system.

Only where glibc is the C library: elsewhere (macOS, musl) nothing is set and the report
says why. A glibc setting in the environment (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_,
GLIBC_TUNABLES) is the operator's and is left alone. DILOCO_MALLOC overrides the defaults for
a comparison: `glibc` leaves glibc's own, `arena_max=2,trim_period_s=0` sets some (0: off).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
SPEC_ENV = "DILOCO_MALLOC"
GLIBC_ENV = {
    "arena_max": ("MALLOC_ARENA_MAX", "glibc.malloc.arena_max"),
    "mmap_threshold_bytes": ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
}
"""Per setting, glibc's environment variable and tunable that name it (the operator's)."""


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    arena_max: int | None = 2
    """Arenas every thread shares (glibc's default: 8 per core); None leaves glibc's."""
    mmap_threshold_bytes: int | None = None
    """Allocations this large and above are mmapped, and unmapped when freed; None (the
    default) leaves glibc's dynamic threshold: a fixed 512 KiB one cost 14-26 % of `small`'s
    CPU training throughput (activations mmapped and faulted in at every step; lead, session
    9, 4 pairs side by side), so it is for a comparison (DILOCO_MALLOC) only."""
    trim_period_s: float | None = 10.0
    """Seconds between two malloc_trim(0) calls; None: never."""

    def __post_init__(self) -> None:
        if self.arena_max is not None and self.arena_max < 1:
            raise ValueError(f"arena_max must be >= 1, got {self.arena_max!r}.")
        if self.mmap_threshold_bytes is not None and not 0 < self.mmap_threshold_bytes <= 1 << 25:
            raise ValueError(
                f"mmap_threshold_bytes must be 1 to 32 MiB, got {self.mmap_threshold_bytes!r}."
            )
        if self.trim_period_s is not None and not self.trim_period_s > 0:
            raise ValueError(f"trim_period_s must be > 0, got {self.trim_period_s!r}.")


def parse_spec(spec: str) -> AllocatorConfig:
    """`glibc` (every glibc default) or `name=value,...` over the defaults (0: that one off)."""
    if spec.strip() == "glibc":
        return AllocatorConfig(arena_max=None, mmap_threshold_bytes=None, trim_period_s=None)
    names = {f.name for f in dataclasses.fields(AllocatorConfig)}
    values: dict[str, float | None] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, text = item.partition("=")
        if name not in names or not text:
            raise ValueError(f"{SPEC_ENV}: '{item}' is not one of {sorted(names)} = a number.")
        try:
            number = float(text) if name == "trim_period_s" else int(text)
        except ValueError:
            raise ValueError(f"{SPEC_ENV}: '{item}' is not a number.") from None
        values[name] = number or None
    return dataclasses.replace(AllocatorConfig(), **values)  # type: ignore[arg-type]


def config_from_env(environ: Mapping[str, str]) -> tuple[AllocatorConfig, list[str]]:
    """The config DILOCO_MALLOC asks for, less what glibc's environment already sets; and
    the names of those left to the environment."""
    config = parse_spec(environ.get(SPEC_ENV, ""))
    tunables = environ.get("GLIBC_TUNABLES", "")
    left: list[str] = []
    for name, (variable, tunable) in GLIBC_ENV.items():
        if variable in environ or tunable in tunables:
            config = dataclasses.replace(config, **{name: None})
            left.append(variable if variable in environ else tunable)
    return config, left


def glibc() -> ctypes.CDLL | None:
    """The running process's C library when it is glibc with mallopt and malloc_trim."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    wanted = ("gnu_get_libc_version", "mallopt", "malloc_trim")
    return libc if all(hasattr(libc, name) for name in wanted) else None


@dataclass
class Trims:
    """What the malloc_trim(0) calls cost and gave back."""

    num_trims: int = 0
    seconds: float = 0.0
    max_s: float = 0.0
    released_mb: float = 0.0
    """RSS drops across the calls, summed."""

    def add(self, seconds: float, rss_before: float, rss_after: float) -> None:
        self.num_trims += 1
        self.seconds += seconds
        self.max_s = max(self.max_s, seconds)
        self.released_mb += max(0.0, rss_before - rss_after)

    def fields(self) -> dict[str, float]:
        return {
            "num_trims": self.num_trims,
            "trim_s": round(self.seconds, 4),
            "trim_max_s": round(self.max_s, 4),
            "trim_released_mb": round(self.released_mb, 1),
        }


@dataclass
class Allocator:
    """What was set (`applied`), or why nothing was (`skipped`); the trimmer's figures."""

    applied: dict[str, float] = field(default_factory=dict)
    left_to_environment: list[str] = field(default_factory=list)
    libc: str | None = None
    skipped: str | None = None
    trims: Trims = field(default_factory=Trims)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def fields(self) -> dict[str, object]:
        """For the `allocator` event: what was set, or why nothing was."""
        return {
            "libc": self.libc,
            "applied": self.applied,
            "left_to_environment": self.left_to_environment,
            "skipped": self.skipped,
        }

    def start_trimming(self, libc: ctypes.CDLL, period_s: float) -> None:
        self._thread = threading.Thread(
            target=self._trim_every, args=(libc, period_s), name="malloc-trim", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _trim_every(self, libc: ctypes.CDLL, period_s: float) -> None:
        while not self._stop.wait(period_s):
            before, started = rss_mb(), time.perf_counter()
            libc.malloc_trim(0)
            self.trims.add(time.perf_counter() - started, before, rss_mb())


def bound_allocator(config: AllocatorConfig, libc: ctypes.CDLL | None = None) -> Allocator:
    """Apply `config` to this process's glibc (call before its threads exist)."""
    libc = libc or glibc()
    if libc is None:
        return Allocator(skipped=f"not glibc ({sys.platform}): the allocator is left as it is")
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    allocator = Allocator(libc=f"glibc {libc.gnu_get_libc_version().decode()}")
    for option, name in ((M_ARENA_MAX, "arena_max"), (M_MMAP_THRESHOLD, "mmap_threshold_bytes")):
        value = getattr(config, name)
        if value is not None:
            if libc.mallopt(option, int(value)) != 1:
                logger.warning("glibc refused mallopt %s=%d", name, value)
                continue
            allocator.applied[name] = int(value)
    if config.trim_period_s is not None:
        allocator.applied["trim_period_s"] = config.trim_period_s
        allocator.start_trimming(libc, config.trim_period_s)
    return allocator


@contextmanager
def bounded_allocator(environ: Mapping[str, str]) -> Iterator[Allocator]:
    """The allocator bound as DILOCO_MALLOC and glibc's environment say, for a node's run."""
    config, left = config_from_env(environ)
    allocator = bound_allocator(config)
    allocator.left_to_environment = left
    logger.debug("allocator: %s", allocator.fields())
    try:
        yield allocator
    finally:
        allocator.stop()


def rss_mb() -> float:
    """This process's resident set in MiB (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0
