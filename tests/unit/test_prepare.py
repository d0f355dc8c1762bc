"""What the suite's controller writes before its workers start (tests/prepare.py): bytecode, and
pytest's assertion-rewritten test modules, which pytest then reads instead of rewriting."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from _pytest.assertion import rewrite

from tests.prepare import is_test_module, prepare, rewrite_test_module, rewritten_pyc

TEST_MODULE = "def test_it():\n    left = [1, 2]\n    assert left == [1, 3]\n"


def failure_of(code: object) -> str:
    """The message of the assert the module's test fails on."""
    namespace: dict[str, object] = {}
    exec(code, namespace)  # type: ignore[arg-type]
    try:
        namespace["test_it"]()  # type: ignore[operator]
    except AssertionError as exc:
        return str(exc)
    raise AssertionError("the test passed")


def test_a_written_module_is_what_pytest_reads_with_its_rewritten_asserts(tmp_path: Path) -> None:
    module = tmp_path / "test_x.py"
    module.write_text(TEST_MODULE)
    assert rewrite._read_pyc(module, rewritten_pyc(module)) is None
    assert rewrite_test_module(module)
    code = rewrite._read_pyc(module, rewritten_pyc(module))
    assert code is not None
    assert "[1, 2] == [1, 3]" in failure_of(code)  # pytest's introspection, not a bare assert


def test_a_changed_module_is_written_again_and_a_broken_one_is_left_to_pytest(
    tmp_path: Path,
) -> None:
    module = tmp_path / "test_x.py"
    module.write_text(TEST_MODULE)
    assert rewrite_test_module(module)
    module.write_text(TEST_MODULE.replace("[1, 3]", "[1, 4]"))
    os.utime(module, (1, 1))  # an mtime the first write cannot have had
    assert rewrite_test_module(module)
    code = rewrite._read_pyc(module, rewritten_pyc(module))
    assert code is not None and "[1, 4]" in failure_of(code)
    broken = tmp_path / "test_broken.py"
    broken.write_text("def test_it(:\n")
    assert not rewrite_test_module(broken)
    assert not rewritten_pyc(broken).exists()


def test_the_controller_compiles_the_sources_and_rewrites_only_test_modules(
    tmp_path: Path,
) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    sources = [tmp_path / "pkg" / f"m{i}.py" for i in range(20)]
    for source in sources:
        source.write_text("VALUE = 1\n")
    modules = [tmp_path / "tests" / "sub" / "test_a.py", tmp_path / "tests" / "conftest.py"]
    for module in modules:
        module.write_text(TEST_MODULE)
    helper = tmp_path / "tests" / "helpers.py"
    helper.write_text(TEST_MODULE)

    assert prepare(tmp_path, ["pkg", "tests"], "tests", rewrite_asserts=True)
    assert all(Path(importlib.util.cache_from_source(str(s))).exists() for s in sources)
    assert all(rewrite._read_pyc(m, rewritten_pyc(m)) is not None for m in modules)
    assert not rewritten_pyc(helper).exists() and not is_test_module(helper)


def test_without_rewriting_the_controller_only_compiles(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    module = tmp_path / "tests" / "test_a.py"
    module.write_text(TEST_MODULE)
    assert prepare(tmp_path, ["tests"], "tests", rewrite_asserts=False)
    assert Path(importlib.util.cache_from_source(str(module))).exists()
    assert not rewritten_pyc(module).exists()
