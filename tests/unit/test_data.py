from pathlib import Path

import numpy as np
import pytest
import torch

from node import data as data_module
from node.data import (
    MIN_TOKENS,
    Corpus,
    DataError,
    ShardSampler,
    default_corpus_dir,
    load_corpus,
    split_corpus,
    validation_batches,
)

TEXT = b"def f(x):\n    return x + 1\n" * 200  # comfortably above MIN_TOKENS


@pytest.fixture(scope="module")
def default_corpus() -> Corpus:
    return load_corpus(None)


def test_default_corpus_is_the_stdlib_source(default_corpus: Corpus):
    assert default_corpus.num_tokens > 1_000_000
    assert default_corpus.vocab_size == 256
    assert default_corpus.tokens.dtype == np.uint8
    assert "standard library" in default_corpus.source
    assert (default_corpus_dir() / "os.py").read_bytes() in default_corpus.tokens.tobytes()


def test_default_corpus_excludes_installed_packages(default_corpus: Corpus):
    # pytest is installed under site-packages, which (e.g. in a venv-less install) can sit
    # inside the stdlib directory; its source must not leak into the corpus.
    installed = Path(pytest.__file__).read_bytes()
    assert installed not in default_corpus.tokens.tobytes()


def test_text_file_loads_as_bytes(tmp_path: Path):
    path = tmp_path / "book.txt"
    path.write_bytes(TEXT)
    corpus = load_corpus(path)
    assert corpus.tokens.tobytes() == TEXT
    assert corpus.vocab_size == 256
    assert corpus.num_tokens == len(TEXT)


def test_directory_joins_text_files_in_path_order(tmp_path: Path):
    (tmp_path / "b.txt").write_bytes(TEXT)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.py").write_bytes(b"first")
    (tmp_path / ".hidden.txt").write_bytes(b"hidden")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_bytes(b"hidden dir")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "m.txt").write_bytes(b"cache")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\0\0" + b"x" * 100)
    corpus = load_corpus(str(tmp_path))
    assert corpus.tokens.tobytes() == b"first\n" + TEXT
    assert "2 files" in corpus.source


def test_bin_file_loads_uint16_tokens(tmp_path: Path):
    tokens = (np.arange(MIN_TOKENS, dtype=np.uint16) * 7) % 300
    path = tmp_path / "tokens.bin"
    tokens.astype("<u2").tofile(path)
    corpus = load_corpus(path)
    assert corpus.tokens.dtype == np.uint16
    assert np.array_equal(corpus.tokens, tokens)
    assert corpus.vocab_size == 320  # max token 299, rounded up to a multiple of 64


def test_bin_file_with_odd_length_is_rejected(tmp_path: Path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"\0" * (2 * MIN_TOKENS + 1))
    with pytest.raises(DataError, match="odd byte length"):
        load_corpus(path)


def test_missing_path_is_rejected(tmp_path: Path):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(tmp_path / "nope.txt")


def test_unreadable_file_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "secret.txt"
    path.write_bytes(TEXT)

    def deny(file: object, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(file))

    # chmod does not stop root, which CI may be; node.data opens files with the builtin open
    monkeypatch.setattr(data_module, "open", deny, raising=False)
    with pytest.raises(DataError, match="permission denied"):
        load_corpus(path)
    with pytest.raises(DataError, match="permission denied"):
        load_corpus(tmp_path)


def test_directory_without_text_files_is_rejected(tmp_path: Path):
    (tmp_path / "blob.dat").write_bytes(b"\0" * MIN_TOKENS)
    (tmp_path / ".notes.txt").write_bytes(TEXT)
    with pytest.raises(DataError, match="contains no text files"):
        load_corpus(tmp_path)


def test_too_small_corpus_is_rejected(tmp_path: Path):
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * (MIN_TOKENS - 1))
    with pytest.raises(DataError, match="short.txt"):
        load_corpus(path)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


def _corpus(num_tokens: int) -> Corpus:
    return Corpus(tokens=np.arange(num_tokens, dtype=np.uint16), vocab_size=65536, source="test")


def test_split_holds_out_the_corpus_tail():
    split = split_corpus(_corpus(60_000), val_tokens=4_000)
    assert np.array_equal(split.val, np.arange(56_000, 60_000))
    assert np.array_equal(split.train, np.arange(56_000))


def test_split_validation_is_at_most_ten_percent():
    split = split_corpus(_corpus(20_000))
    assert len(split.val) == 2_000
    assert len(split.train) == 18_000


def _stream(sampler: ShardSampler, num_batches: int) -> list[torch.Tensor]:
    return [torch.cat(sampler.next_batch()) for _ in range(num_batches)]


def _sampler(seed: str, train: np.ndarray | None = None) -> ShardSampler:
    train = np.arange(50_000, dtype=np.uint16) if train is None else train
    return ShardSampler(train, seed=seed, batch_size=4, block_size=16)


def test_batches_are_next_token_windows_of_the_training_tokens():
    x, y = _sampler("node-a").next_batch()
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    # train[i] == i, so each row must be a consecutive run and y must be x shifted by one.
    assert torch.equal(x[:, 1:] - x[:, :1], torch.arange(1, 16).expand(4, -1))
    assert torch.equal(y, x + 1)


def test_same_seed_gives_the_same_stream():
    assert all(map(torch.equal, _stream(_sampler("node-a"), 3), _stream(_sampler("node-a"), 3)))


def test_different_seeds_give_different_shards():
    a, b = _stream(_sampler("node-a"), 3), _stream(_sampler("node-b"), 3)
    assert not any(map(torch.equal, a, b))


def test_bytes_and_str_seeds_agree():
    from_bytes = ShardSampler(np.arange(1000), seed=b"node-a", batch_size=4, block_size=16)
    assert torch.equal(
        from_bytes.next_batch()[0], _sampler("node-a", np.arange(1000)).next_batch()[0]
    )


def test_resume_from_state_dict_continues_the_stream():
    original = _sampler("node-a")
    _stream(original, 5)
    state = original.state_dict()
    assert state == {"num_batches": 5}
    resumed = _sampler("node-a")
    resumed.load_state_dict(state)
    assert all(map(torch.equal, _stream(original, 3), _stream(resumed, 3)))


def test_sampler_rejects_a_training_split_shorter_than_a_window():
    with pytest.raises(ValueError, match="fewer than one window"):
        ShardSampler(np.arange(16), seed="node-a", batch_size=4, block_size=16)


def test_sampler_streams_the_default_corpus(default_corpus: Corpus):
    split = split_corpus(default_corpus)
    x, y = ShardSampler(split.train, seed="node-a", batch_size=2, block_size=128).next_batch()
    assert x.shape == (2, 128)
    assert int(x.max()) < default_corpus.vocab_size


def test_validation_batches_are_fixed_and_span_the_slice():
    val = np.arange(10_000, dtype=np.uint16)
    first = validation_batches(val, batch_size=4, block_size=32, num_batches=3)
    second = validation_batches(val, batch_size=4, block_size=32, num_batches=3)
    assert len(first) == 3
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(first, second, strict=True)
    )
    starts = torch.cat([x[:, 0] for x, _ in first])
    assert starts[0] == 0
    assert first[-1][1][-1, -1] == 9_999  # the last window reaches the end of the slice
    assert len(set(starts.tolist())) == 12


def test_validation_batches_reject_a_slice_shorter_than_a_window():
    with pytest.raises(ValueError, match="fewer than one window"):
        validation_batches(np.arange(32), batch_size=1, block_size=32, num_batches=1)
