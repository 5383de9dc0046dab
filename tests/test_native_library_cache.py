"""The native loops' library cache (docs/guides/backends.md, "native loops"): a cached file that does not load is
rebuilt, `$CC` may carry arguments, and a relative `CANN_ATTN_CACHE_DIR` is refused with a warning.

A fuzz found that a 0-byte cached library (left by a crash or a full disk) was never rebuilt, so every later process
silently ran the slow PyTorch path; `CC="cc -O0"` failed to build (run as one program name); a relative cache dir
named a different cache in every working directory.
"""

from __future__ import annotations

import shutil
import warnings

import pytest

from cann_attn.backends.reference import native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or not native.enabled_by_environment(),
                                reason="needs a C compiler and the native loops switched on")


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """library() as in a new process, caching into tmp_path."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv(native.CACHE_DIR_VARIABLE, str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    return tmp_path


@pytest.mark.parametrize("content", [b"", b"\x7fELF truncated"], ids=["empty", "truncated"])
def test_a_cached_library_that_does_not_load_is_rebuilt(fresh_loader, content: bytes) -> None:
    target = native.library_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(content)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "could not be loaded" warning either
        lib = native.library()
    assert lib is not None, "the corrupt cached library was not rebuilt"
    assert target.stat().st_size > 1000
    assert [p.name for p in fresh_loader.iterdir()] == [target.name], "the build's temporary file was left behind"


def test_cc_with_arguments(fresh_loader, monkeypatch) -> None:
    monkeypatch.setenv("CC", "cc -O0 -DCANN_ATTN_CC_ARGUMENT_TEST=1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library() is not None
    assert native.library_path().is_file()


def test_a_relative_cache_dir_is_refused(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(native.CACHE_DIR_VARIABLE, "relative/cache")
    with pytest.warns(RuntimeWarning, match="CANN_ATTN_CACHE_DIR='relative/cache' is not an absolute path"):
        assert native.cache_dir() == tmp_path / "cann_attn"
    monkeypatch.setenv(native.CACHE_DIR_VARIABLE, "~/attn-cache")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert native.cache_dir() == tmp_path / "attn-cache"


def test_every_included_source_keys_the_cache(monkeypatch, tmp_path) -> None:
    """attention_loops.c includes one file per kernel family: an edit to any of them must build a new library
    (a stale cached one would run the old loops), and every file it includes is one that keys the cache."""
    sources = native.sources()
    names = {p.name for p in sources}
    included = {line.split('"')[1] for p in sources for line in p.read_text().splitlines()
                if line.startswith('#include "')}
    assert native.SOURCE in sources and included and included <= names, included - names
    assert names - included == {native.SOURCE.name}, "a source file that nothing includes"
    copy = tmp_path / "native"
    copy.mkdir()
    for p in sources:
        shutil.copy(p, copy / p.name)
    monkeypatch.setattr(native, "SOURCE", copy / native.SOURCE.name)
    before = native.library_path()
    for name in sorted(included):
        edited = copy / name
        original = edited.read_text()
        edited.write_text(original + "\n/* edited */\n")
        assert native.library_path() != before, f"an edit to {name} left the cache key unchanged"
        edited.write_text(original)
        assert native.library_path() == before
