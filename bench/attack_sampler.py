"""What bench.attack samples of its processes while a run lasts: each honest node's RSS and
open files, every child's process-tree CPU seconds, and the tracebacks in a node's stderr."""

from __future__ import annotations

import contextlib
import time
from collections import deque

import psutil

from bench.procs import ChildProcess
from bench.sampling import BackgroundSampler, open_files, rss_bytes

TRACEBACK = "Traceback (most recent call last)"


class TracebackCounter(deque[str]):
    """A child's stderr lines (the last `maxlen`), counting every traceback that went by."""

    def __init__(self, maxlen: int) -> None:
        super().__init__(maxlen=maxlen)
        self.tracebacks = 0

    def append(self, line: str) -> None:
        self.tracebacks += TRACEBACK in line
        super().append(line)


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process and its descendants have used so far (its p2pd
    and DHT processes among them; children it has reaped counted too), or None when it is
    gone."""
    try:
        root = psutil.Process(pid)
        times = root.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child_times = child.cpu_times()
                total += child_times.user + child_times.system
        return total
    except psutil.Error:
        return None


class Sampler(BackgroundSampler):
    """RSS and open files of each honest node's main process, once a second, with the time
    (a node that has exited, or whose figures cannot be read, is left out of that sample);
    and the CPU seconds of every child's process tree (`cpu`: the adversary's too), so that
    what an adversary costs the machine's cores can be told from what it does to the
    protocol."""

    def __init__(self, nodes: list[ChildProcess], children: list[ChildProcess]) -> None:
        super().__init__(period_s=1.0)
        self.nodes = nodes
        self.children = children
        self.samples: list[tuple[float, dict[str, tuple[float, int]]]] = []
        self.cpu: dict[str, list[tuple[float, float]]] = {}

    def sample(self) -> None:
        figures: dict[str, tuple[float, int]] = {}
        for node in [n for n in list(self.nodes) if n.alive()]:
            rss, files = rss_bytes(node.pid), open_files(node.pid)
            if rss is not None and files is not None:
                figures[node.name] = (rss / 2**20, files)
        now = time.time()
        self.samples.append((now, figures))
        for child in [c for c in list(self.children) if c.alive()]:
            cpu = tree_cpu_s(child.pid)
            if cpu is not None:
                self.cpu.setdefault(child.name, []).append((now, cpu))

    def cpu_s(self, since: float, until: float) -> dict[str, float]:
        """Each child's CPU seconds between `since` and `until` (its samples within them)."""
        used = {}
        for name, samples in self.cpu.items():
            within = [cpu for t, cpu in samples if since <= t <= until]
            if within:
                used[name] = round(max(within) - min(within), 1)
        return used

    def rss_growth_mb(self, since: float, names: list[str]) -> float:
        """The most any of `names` rose above its last RSS sample before `since` (a node that
        starts later, the newcomer, grows as it loads: not counted)."""
        before: dict[str, float] = {}
        growth = 0.0
        for t, sample in self.samples:
            for name, (rss, _) in sample.items():
                if name not in names:
                    continue
                if t <= since or name not in before:
                    before[name] = rss
                else:
                    growth = max(growth, rss - before[name])
        return growth

    def peak_mb(self, name: str) -> float:
        return max((s[name][0] for _, s in self.samples if name in s), default=0.0)

    def max_open_files(self, since: float) -> int:
        return max((f for t, s in self.samples if t >= since - 1 for _, f in s.values()), default=0)
