"""The API reference (docs/api.md, built by mkdocstrings with docs/griffe_api.py): every parameter of every public
function has its own meaning, and every documentation page a docstring cites becomes a link to a page that exists."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
griffe_api = pytest.importorskip("griffe_api", reason="docs/griffe_api.py needs griffe (the docs extra)")

MODULES = ("cann_attn", "cann_attn.torch_npu", "cann_attn.distributed")
ARGS_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters):\s*$", re.MULTILINE)


def public_functions() -> list[tuple[str, str, object]]:
    """(module, name, function) of every public function the API page shows."""
    found = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name, None)
            if callable(obj) and not inspect.isclass(obj) and inspect.getdoc(obj):
                found.append((module_name, name, obj))
    return found


def own_args(doc: str) -> set[str]:
    """The parameter names a docstring's own Args section describes."""
    match = ARGS_SECTION.search(doc)
    if not match:
        return set()
    return set(re.findall(r"^\s{4}(\w+)\s*(?:\(.*?\))?:", doc[match.end():], re.MULTILINE))


def test_every_parameter_of_every_public_function_has_a_meaning():
    missing = []
    for module_name, name, function in public_functions():
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):
            continue
        described = own_args(inspect.getdoc(function) or "")
        for parameter in parameters:
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or parameter.name in described:
                continue
            if griffe_api.meaning_of(parameter.name, name) is None:
                missing.append(f"{module_name}.{name}({parameter.name})")
    assert not missing, "parameters without a meaning (add them to docs/griffe_api.py MEANINGS): " + ", ".join(missing)


def test_meanings_link_pages_and_anchors_that_exist():
    entries = list(griffe_api.MEANINGS.items()) + [
        (name, entry) for names in griffe_api._FOR_OPERATOR.values() for name, entry in names.items()]
    for name, (text, page) in entries:
        assert text and "see the operator page" not in text.lower(), name
        path, _, anchor = page.partition("#")
        source = ROOT / "docs" / path
        assert source.is_file(), (name, page)
        if anchor:
            headings = [re.sub(r"[^\w\s-]", "", h).strip().lower().replace(" ", "-")
                        for h in re.findall(r"^#+ (.+)$", source.read_text(encoding="utf-8"), re.MULTILINE)]
            assert anchor in headings, (name, page)


def test_operator_specific_meanings_win_for_their_operator_only():
    assert "2" in griffe_api.meaning_of("key_quant_mode", "npu_kv_quant_sparse_flash_attention")[0]
    assert "v2 name" in griffe_api.meaning_of("key_quant_mode", "fused_infer_attention_score_v2")[0]
    assert griffe_api.meaning_of("key_quant_mode", "flash_attention_score") is None
    assert griffe_api.meaning_of("no_such_parameter", "fused_infer_attention_score") is None


def test_docstrings_cite_pages_as_links():
    """A `docs/...md` path in a docstring is turned into a link by griffe_api; a path broken over two lines, or to
    a page that does not exist, would stay plain text or a broken link."""
    problems = []
    for module_name, name, function in public_functions():
        doc = inspect.getdoc(function) or ""
        for match in re.finditer(r"docs/", doc):
            cited = griffe_api._DOC_PATH.match(doc, match.start() - (doc[match.start() - 1] == "`"))
            page = cited and ROOT / "docs" / cited[1]
            if not cited or not page.is_file():
                problems.append(f"{module_name}.{name}: {doc[match.start():match.start() + 50]!r}")
    assert not problems, "docstring paths that do not become links:\n" + "\n".join(problems)
