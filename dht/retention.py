"""Updates a node keeps to serve to peers that missed them: a byte budget in memory, the rest
spilled to a per-node directory on disk that is removed when the node stops."""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from dht.grouping_wire import encode_update
from merge.group_pipeline import GroupMerge

logger = logging.getLogger(__name__)
UpdateId = tuple[str, int]
FRESH_MEMORY_SHARE = 1 / 32
"""The share of the memory budget that authors without a track record hold together: 40 Sybil
keys' updates filled all 256 MB of it (bench.attack sybil_learners: +250 MB RSS); an eighth
(32 MB) still left the class +69 MB over the clean peak, against a 60 MB bound. A 32nd is 8 MB
of the default budget: an honest newcomer's few updates a round fit, the rest spill to disk."""


class RetainedUpdates:
    """The last `per_author` updates of each author, as wire bytes; thread-safe.

    At most `budget_bytes` are held in memory; older updates beyond it are written to disk
    (one file each) and read back when a peer asks for them. Updates of fresh authors
    (`is_fresh`, set by the node from merge's ledger) hold at most FRESH_MEMORY_SHARE of it
    together, however many keys publish.
    """

    def __init__(self, *, per_author: int, budget_bytes: int, spill_dir: Path | None = None):
        if per_author < 1 or budget_bytes < 0:
            raise ValueError("retention needs per_author >= 1 and budget_bytes >= 0.")
        self.per_author = per_author
        self.budget_bytes = budget_bytes
        self._spill_root = spill_dir
        self._dir: Path | None = None
        self._lock = threading.Lock()
        self._memory: OrderedDict[UpdateId, bytes] = OrderedDict()
        self._on_disk: dict[UpdateId, int] = {}
        self._by_author: dict[str, list[int]] = {}
        self.memory_bytes = 0
        self.disk_bytes = 0
        self.is_fresh: Callable[[str], bool] = lambda author: False
        """Whether an author has no track record (its updates share the fresh budget)."""
        self._fresh: OrderedDict[UpdateId, int] = OrderedDict()
        """Fresh authors' updates in memory, oldest first, and their sizes."""
        self.fresh_bytes = 0

    def put(self, uid: UpdateId, data: bytes) -> None:
        fresh = self.is_fresh(uid[0])  # outside the lock: it takes the replica's
        with self._lock:
            if uid in self._memory or uid in self._on_disk:
                return
            self._memory[uid] = data
            self.memory_bytes += len(data)
            if fresh:
                self._fresh[uid] = len(data)
                self.fresh_bytes += len(data)
            seqs = self._by_author.setdefault(uid[0], [])
            seqs.append(uid[1])
            seqs.sort()
            while len(seqs) > self.per_author:
                self._drop((uid[0], seqs.pop(0)))
            self._spill_over_budget()

    def supersede(self, uid: UpdateId, data: bytes | None) -> None:
        """The variant applied here under `uid` changed (merge.group_pipeline
        `on_superseded`): what is held under it goes, and `data` (a learner group's prevailing
        variant, stepped in place of the lesser one) is held instead; None: nothing is served
        under the id (its variant withdrawn here, superseded or voided). `put` keeps the first
        bytes under an id: the one variant a merge accepts, but for this."""
        with self._lock:
            self._drop(uid)
            self._forget_seq(uid)
        if data is not None:
            self.put(uid, data)

    def get(self, uid: UpdateId) -> bytes | None:
        with self._lock:
            data = self._memory.get(uid)
            if data is not None or uid not in self._on_disk:
                return data
            path = self._path(uid)
        try:
            return path.read_bytes()
        except OSError:  # evicted meanwhile
            return None

    def ids(self) -> list[UpdateId]:
        with self._lock:
            return [*self._memory, *self._on_disk]

    def seqs(self, author: str) -> list[int]:
        """The seqs of `author` retained, ascending (what this node's holder record names)."""
        with self._lock:
            return list(self._by_author.get(author, ()))

    def __contains__(self, uid: object) -> bool:
        with self._lock:
            return uid in self._memory or uid in self._on_disk

    def close(self) -> None:
        """Forget everything and remove the spill directory."""
        with self._lock:
            self._memory.clear()
            self._fresh.clear()
            self.fresh_bytes = 0
            self._on_disk.clear()
            self._by_author.clear()
            self.memory_bytes = self.disk_bytes = 0
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    # ---- internals (lock held) -------------------------------------------------------------

    def _spill_over_budget(self) -> None:
        while self.fresh_bytes > self.budget_bytes * FRESH_MEMORY_SHARE:
            self._spill(next(iter(self._fresh)))
        while self.memory_bytes > self.budget_bytes and self._memory:
            self._spill(next(iter(self._memory)))

    def _spill(self, uid: UpdateId) -> None:
        data = self._pop_memory(uid)
        if data is not None:
            try:
                self._path(uid).write_bytes(data)
            except OSError as exc:  # a full disk costs retention, never the node
                logger.warning("could not spill update %s#%d to disk: %s", *uid, exc)
                self._forget_seq(uid)
                return
            self._on_disk[uid] = len(data)
            self.disk_bytes += len(data)

    def _pop_memory(self, uid: UpdateId) -> bytes | None:
        data = self._memory.pop(uid, None)
        if data is not None:
            self.memory_bytes -= len(data)
            self.fresh_bytes -= self._fresh.pop(uid, 0)
        return data

    def _drop(self, uid: UpdateId) -> None:
        self._pop_memory(uid)
        size = self._on_disk.pop(uid, None)
        if size is not None:
            self.disk_bytes -= size
            self._path(uid).unlink(missing_ok=True)

    def _forget_seq(self, uid: UpdateId) -> None:
        seqs = self._by_author.get(uid[0], [])
        if uid[1] in seqs:
            seqs.remove(uid[1])

    def _path(self, uid: UpdateId) -> Path:
        if self._dir is None:
            root = self._spill_root
            if root is not None:
                root.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix="diloco-spill-", dir=root))
        safe_author = "".join(c if c.isalnum() else "_" for c in uid[0])[:128]
        return self._dir / f"{safe_author}-{uid[1]}.update"


def serve_superseded(merge: object, retained: RetainedUpdates) -> None:
    """Keeps `retained` serving the variant `merge` (a pipeline with learner groups) holds
    applied under each id: the prevailing one once it stepped in, none once withdrawn."""
    groups = getattr(merge, "groups", None)
    if isinstance(groups, GroupMerge):
        groups.on_superseded.append(
            lambda uid, update: retained.supersede(
                uid, None if update is None else encode_update(update)
            )
        )
