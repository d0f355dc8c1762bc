"""Training corpora, the shared validation slice, and each node's deterministic data shard."""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

MIN_TOKENS = 4 * 1024
"""Smallest usable corpus: its 10% validation slice and the training rest must each hold a
few windows at the small presets' block sizes (larger block sizes are checked by
ShardSampler and validation_batches)."""

_SNIFF_BYTES = 8 * 1024
_SKIPPED_DIRS = frozenset({"__pycache__"})
_NON_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class DataError(ValueError):
    """A corpus path that cannot be turned into training tokens."""


@dataclass(frozen=True, eq=False)
class Corpus:
    tokens: np.ndarray
    """1-D token ids: uint8 bytes for text, uint16 for pre-tokenized .bin (maybe a memmap)."""
    vocab_size: int
    """Number of distinct token ids the model must embed."""
    source: str
    """Human description of where the tokens came from."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True, eq=False)
class Split:
    train: np.ndarray
    """Everything before the validation slice."""
    val: np.ndarray
    """The corpus tail, identical on every node that has the same corpus."""


def default_corpus_dir() -> Path:
    """The running interpreter's standard library source tree."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(path: str | Path | None) -> Corpus:
    """Load a corpus: None for the stdlib default, a text file, a directory, or a .bin file."""
    if path is None:
        corpus = _load_default()
    else:
        path = Path(path)
        if not path.exists():
            raise DataError(f"corpus path {path} does not exist.")
        if path.is_dir():
            corpus = _load_directory(path)
        elif path.suffix == ".bin":
            corpus = _load_bin(path)
        else:
            data = _read(path)
            corpus = Corpus(
                tokens=np.frombuffer(data, dtype=np.uint8),
                vocab_size=256,
                source=f"{path} ({_megabytes(len(data))})",
            )
    if corpus.num_tokens < MIN_TOKENS:
        raise DataError(
            f"corpus {corpus.source} has {corpus.num_tokens:,} tokens, "
            f"fewer than the {MIN_TOKENS:,} needed for validation and training."
        )
    return corpus


def _load_default() -> Corpus:
    root = default_corpus_dir()
    files = _list_files(
        root,
        keep_dir=lambda name: name not in _NON_STDLIB_DIRS,
        keep_file=lambda name: name.endswith(".py"),
    )
    if not files:
        raise DataError(f"no Python source files under {root}; pass a corpus path instead.")
    data = b"\n".join(_read(f) for f in files)
    details = f"{root}, {_count(files)}, {_megabytes(len(data))}"
    return Corpus(
        tokens=np.frombuffer(data, dtype=np.uint8),
        vocab_size=256,
        source=f"Python {sysconfig.get_python_version()} standard library ({details})",
    )


def _load_directory(root: Path) -> Corpus:
    files = _list_files(
        root,
        keep_dir=lambda name: not name.startswith(".") and name not in _SKIPPED_DIRS,
        keep_file=lambda name: not name.startswith("."),
    )
    texts = [data for data in (_read_if_text(f) for f in files) if data is not None]
    if not texts:
        raise DataError(f"directory {root} contains no text files.")
    data = b"\n".join(texts)
    return Corpus(
        tokens=np.frombuffer(data, dtype=np.uint8),
        vocab_size=256,
        source=f"{root} ({_count(texts)}, {_megabytes(len(data))})",
    )


def _load_bin(path: Path) -> Corpus:
    num_bytes = path.stat().st_size
    if num_bytes % 2:
        raise DataError(f"{path} has an odd byte length ({num_bytes}), so it is not uint16 tokens.")
    if num_bytes == 0:
        raise DataError(f"{path} is empty.")
    try:
        tokens = np.memmap(path, dtype="<u2", mode="r")
    except PermissionError as e:
        raise DataError(f"cannot read {path}: permission denied.") from e
    vocab_size = -(-(int(tokens.max()) + 1) // 64) * 64
    return Corpus(
        tokens=tokens,
        vocab_size=vocab_size,
        source=f"{path} ({tokens.shape[0]:,} uint16 tokens, vocab {vocab_size})",
    )


def _list_files(
    root: Path, *, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]
) -> list[str]:
    """Regular files under root, sorted by relative path (with "/") so every machine agrees on
    order. Paths as strings: a Path per file made the default corpus's ~1,800 files cost ~3x
    the CPU, on every node's path to its first inner step."""
    top = os.fspath(root)
    found: list[tuple[str, str]] = []  # (relative posix path, path)
    for dirpath, dirnames, filenames in os.walk(top, onerror=_raise_unreadable):
        dirnames[:] = [d for d in dirnames if keep_dir(d)]
        relative = dirpath[len(top) :].lstrip(os.sep).replace(os.sep, "/")
        prefix = relative + "/" if relative else ""
        found += [(prefix + f, os.path.join(dirpath, f)) for f in filenames if keep_file(f)]
    found.sort()
    return [path for _, path in found if os.path.isfile(path)]


def _raise_unreadable(error: OSError) -> None:
    raise DataError(f"cannot read {error.filename}: {error.strerror}.") from error


def _read(path: str | Path) -> bytes:
    try:
        with open(path, "rb", buffering=0) as f:  # one read of the whole file, no buffer
            return f.readall()
    except PermissionError as e:
        raise DataError(f"cannot read {path}: permission denied.") from e


def _read_if_text(path: str | Path) -> bytes | None:
    """The file's bytes, or None if its first 8 KiB contain a NUL byte (a binary file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
            return None if b"\0" in head else head + f.read()
    except PermissionError as e:
        raise DataError(f"cannot read {path}: permission denied.") from e


def _count(files: list[str] | list[bytes]) -> str:
    return f"{len(files):,} file" + ("" if len(files) == 1 else "s")


def _megabytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.1f} MB"


def split_corpus(corpus: Corpus, val_tokens: int = 262_144) -> Split:
    """Hold out the last min(val_tokens, 10% of the corpus) tokens for validation."""
    if val_tokens <= 0:
        raise ValueError(f"val_tokens must be positive, got {val_tokens}.")
    num_val = min(val_tokens, corpus.num_tokens // 10)
    boundary = corpus.num_tokens - num_val
    return Split(train=corpus.tokens[:boundary], val=corpus.tokens[boundary:])


def parse_data_slice(spec: str) -> tuple[int, int]:
    """``K/N`` as (K, N), 0 <= K < N; a clear error for anything else."""
    try:
        k, n = (int(part) for part in spec.split("/"))
    except ValueError:
        raise ValueError(f"--data-slice takes K/N such as 0/3, got {spec!r}") from None
    if not 0 <= k < n <= 4096:
        raise ValueError(f"--data-slice K/N needs 0 <= K < N <= 4096, got {spec!r}")
    return k, n


def data_slice(train: np.ndarray, spec: str | None) -> np.ndarray:
    """The K-th of N equal contiguous slices of ``train`` (all of it without a spec).

    Nodes on different slices of a corpus made of many files see different files: unlike the
    default random windows over the whole split, their data differ in distribution (non-IID).
    """
    if spec is None:
        return train
    k, n = parse_data_slice(spec)
    size = len(train) // n
    return train[k * size : (k + 1) * size]


class ShardSampler:
    """A node's deterministic stream of training batches, seeded by the node's identity.

    Every window offset is drawn uniformly from the whole training range, so a node's shard
    is a random sample rather than a disjoint slice: nodes with different seeds see different
    windows (they overlap only by chance) and need no coordination. Batch k depends only on
    (seed, k), so the stream resumes bit-identically from state_dict().
    """

    def __init__(
        self, train: np.ndarray, *, seed: bytes | str, batch_size: int, block_size: int
    ) -> None:
        if batch_size <= 0 or block_size <= 0:
            raise ValueError(
                f"batch_size and block_size must be positive, got {batch_size} and {block_size}."
            )
        if len(train) < block_size + 1:
            raise ValueError(
                f"the training split has {len(train):,} tokens, "
                f"fewer than one window of block_size + 1 = {block_size + 1}."
            )
        seed_bytes = seed.encode() if isinstance(seed, str) else seed
        self._seed = int.from_bytes(hashlib.sha256(seed_bytes).digest(), "big")
        self._train = train
        self._batch_size = batch_size
        self._block_size = block_size
        self.num_batches = 0

    def next_batch(self) -> tuple[Tensor, Tensor]:
        rng = np.random.default_rng([self._seed, self.num_batches])
        offsets = rng.integers(0, len(self._train) - self._block_size, size=self._batch_size)
        self.num_batches += 1
        return _windows(self._train, offsets, self._block_size)

    def state_dict(self) -> dict[str, int]:
        return {"num_batches": self.num_batches}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        num_batches = state["num_batches"]
        if not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"num_batches must be a non-negative integer, got {num_batches!r}.")
        self.num_batches = num_batches


def validation_batches(
    val: np.ndarray, *, batch_size: int, block_size: int, num_batches: int
) -> list[tuple[Tensor, Tensor]]:
    """Evenly spaced windows over the validation slice; no randomness, same on every node."""
    if batch_size <= 0 or block_size <= 0 or num_batches <= 0:
        raise ValueError("batch_size, block_size and num_batches must all be positive.")
    max_offset = len(val) - block_size - 1
    if max_offset < 0:
        raise ValueError(
            f"the validation split has {len(val):,} tokens, "
            f"fewer than one window of block_size + 1 = {block_size + 1}."
        )
    num_windows = batch_size * num_batches
    offsets = np.arange(num_windows, dtype=np.int64) * max_offset // max(num_windows - 1, 1)
    return [
        _windows(val, offsets[i : i + batch_size], block_size)
        for i in range(0, num_windows, batch_size)
    ]


def _windows(tokens: np.ndarray, offsets: np.ndarray, block_size: int) -> tuple[Tensor, Tensor]:
    """Inputs x and next-token targets y, int64 [len(offsets), block_size] on the CPU."""
    index = offsets[:, None] + np.arange(block_size + 1)
    window = np.asarray(tokens[index], dtype=np.int64)
    x = torch.from_numpy(np.ascontiguousarray(window[:, :-1]))
    y = torch.from_numpy(np.ascontiguousarray(window[:, 1:]))
    return x, y
