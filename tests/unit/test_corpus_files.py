"""The corpus's file list (node.data._list_files, strings since issue 23 for the start-up's
sake) is the one the Path-based listing gave: same files, same order, so the tokens every
node trains on, and the run fingerprint, do not move."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from node.data import _NON_STDLIB_DIRS, _list_files, _read, default_corpus_dir

NAMES = st.sampled_from(["a", "b", "B", "a.py", "b.py", "_x.py", "__pycache__", ".h", "z-1", "a b"])


def _by_paths(
    root: Path, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]
) -> list[Path]:
    """The listing before issue 23's third pass (a Path per file)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if keep_dir(d)]
        found += [Path(dirpath, f) for f in filenames if keep_file(f)]
    return sorted((f for f in found if f.is_file()), key=lambda f: f.relative_to(root).as_posix())


def _keep_dir(name: str) -> bool:
    return name != "__pycache__"


def _keep_file(name: str) -> bool:
    return not name.startswith(".")


@settings(max_examples=30)
@given(st.lists(st.lists(NAMES, min_size=1, max_size=4), max_size=12))
def test_the_listing_is_the_one_paths_gave(trees: list[list[str]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp, "corpus")
        root.mkdir()
        for parts in trees:
            *dirs, leaf = parts
            directory = root.joinpath(*dirs)
            if any(root.joinpath(*dirs[:k]).is_file() for k in range(1, len(dirs) + 1)):
                continue  # a file where a directory would go
            directory.mkdir(parents=True, exist_ok=True)
            target = directory / leaf
            if not target.exists():
                target.write_text("/".join(parts))
        (root / "dangling").symlink_to(root / "nowhere")  # not a regular file: left out
        expected = [str(p) for p in _by_paths(root, _keep_dir, _keep_file)]
        assert _list_files(root, keep_dir=_keep_dir, keep_file=_keep_file) == expected


def test_the_default_corpus_reads_the_same_bytes() -> None:
    root = default_corpus_dir()

    def keep_dir(name: str) -> bool:
        return name not in _NON_STDLIB_DIRS

    def keep_file(name: str) -> bool:
        return name.endswith(".py")

    files = _list_files(root, keep_dir=keep_dir, keep_file=keep_file)
    assert files == [str(p) for p in _by_paths(root, keep_dir, keep_file)]
    assert _read(files[0]) == Path(files[0]).read_bytes()
