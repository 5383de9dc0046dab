"""The one table of torch_npu operator spellings: each public function with its op-plugin schema per release.

Every module of this package that exposes a torch_npu operator decorates its public function with
:func:`npu_op`, giving the operator's schema string exactly as ``op_plugin/config/op_plugin_functions.yaml``
(Ascend/op-plugin) writes it for each torch_npu release that has the operator. That one table drives:

* the release switch (:func:`use_release`, environment variable ``CANN_ATTN_TORCH_NPU_RELEASE``): under an older
  release a function takes only that release's parameters, uses its defaults, returns its number of outputs
  (``npu_fusion_attention_grad`` 4 in 7.2, ``npu_fusion_attention_grad_v2`` 6) and ``inspect.signature`` shows its
  schema;
* :func:`cann_attn.torch_npu.install`, which defines ``torch.ops.npu.<op>`` from the schema of the active release.

A new module adds itself by decorating its functions with ``@npu_op({...})`` and being imported by the package's
``__init__`` (docs/guides/torch_npu.md, "Adding an operator").
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import AclnnError, ParamInvalidError, keywords_checked, unknown_keyword

CURRENT = "current"
# Oldest first: the op-plugin branches 7.1.0, 7.2.0, 7.3.0, 26.0.0 (26.1.0 has the same attention schemas) and
# "current", op-plugin master as read on 2026-08-21 (commit 517f2e7), which adds `sinks` to the DSA operators.
RELEASES = ("7.1", "7.2", "7.3", "26.0", CURRENT)
RELEASE_ENV = "CANN_ATTN_TORCH_NPU_RELEASE"


@dataclass(frozen=True)
class SchemaParam:
    name: str
    type: str
    default: object  # inspect.Parameter.empty when required
    keyword_only: bool


@dataclass(frozen=True)
class Schema:
    """One parsed op-plugin schema line: ``name(params) -> returns``."""

    text: str
    name: str
    params: tuple[SchemaParam, ...]
    returns: tuple[str, ...]

    @property
    def positional_count(self) -> int:
        return sum(not p.keyword_only for p in self.params)

    def signature(self) -> inspect.Signature:
        kinds = {False: inspect.Parameter.POSITIONAL_OR_KEYWORD, True: inspect.Parameter.KEYWORD_ONLY}
        return inspect.Signature([inspect.Parameter(p.name, kinds[p.keyword_only], default=p.default)
                                  for p in self.params])


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    tail = text[start:].strip()
    return [*parts, tail] if tail else parts


def _default_value(text: str, type_name: str):
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text[0] in "\"'":
        return text[1:-1]
    if type_name.startswith("float"):
        return float(text)
    return int(text)


def parse_schema(text: str) -> Schema:
    """Parse ``name(Tensor a, int b=1, *, str c="x") -> (Tensor, int)`` (the op-plugin / torch schema syntax)."""
    match = re.fullmatch(r"\s*([\w.]+)\((.*)\)\s*->\s*(.+?)\s*", text, re.S)
    if match is None:
        raise ValueError(f"not a schema: {text!r}")
    name, body, ret = match.groups()
    params, keyword_only = [], False
    for item in _split_top_level(body):
        if item == "*":
            keyword_only = True
            continue
        decl, _, default = item.partition("=")
        type_name, param_name = decl.rsplit(None, 1)
        value = _default_value(default.strip(), type_name) if default else inspect.Parameter.empty
        params.append(SchemaParam(param_name, type_name, value, keyword_only))
    ret = ret.strip()
    returns = tuple(_split_top_level(ret[1:-1])) if ret.startswith("(") else (ret,)
    return Schema(text, name, tuple(params), returns)


@dataclass
class NpuOp:
    """One torch_npu operator: its implementation (current-release signature), its schema per release and the
    public function that calls the implementation as the active release spells it."""

    name: str
    impl: Callable
    schemas: dict[str, Schema]  # release -> schema; a release without the operator is absent
    wrapper: Callable | None = None  # set by npu_op
    namespace: str = "npu"  # torch.ops.<namespace>: "npu" (op_plugin_functions.yaml) or "atb" (op_plugin/ops/atb)

    def schema(self, release: str) -> Schema:
        """The release's schema; releases older than the operator get its oldest one (the function stays
        callable, it is simply newer than that torch_npu)."""
        if release in self.schemas:
            return self.schemas[release]
        newer = [r for r in RELEASES[RELEASES.index(release):] if r in self.schemas]
        return self.schemas[newer[0]]


OPS: dict[str, NpuOp] = {}
_active = {"release": CURRENT}
# Called instead of the implementation while one is present: graph capture records calls through it (_graphs.py).
CALL_HOOKS: list[Callable] = []


def active_release() -> str:
    return _active["release"]


def _check_release(release: str) -> str:
    release = CURRENT if release in ("", None) else str(release)
    release = re.sub(r"^(\d+\.\d+)\.0$", r"\1", release)  # "7.2.0" -> "7.2"
    if release not in RELEASES:
        raise ParamInvalidError(f"release: expected one of {list(RELEASES)} or 'current', got {release!r}")
    return release


def use_release(release: str) -> str:
    """Make every torch_npu spelling behave as in torch_npu ``release`` ("7.1", "7.2", "7.3", "26.0" or "current";
    "7.2.0" works too): parameters, defaults, signature and number of outputs. Returns the previous release."""
    release = _check_release(release)
    previous = _active["release"]
    _active["release"] = release
    for op in OPS.values():
        _apply_signature(op, release)
    return previous


def _apply_signature(op: NpuOp, release: str) -> None:
    if release == CURRENT or release not in op.schemas:
        op.wrapper.__signature__ = inspect.signature(op.impl)
    else:
        op.wrapper.__signature__ = op.schemas[release].signature()


def npu_op(schemas: dict[tuple[str, ...], str], namespace: str = "npu",
           renamed: dict[str, str] | None = None) -> Callable[[Callable], Callable]:
    """Register a torch_npu spelling with its op-plugin schema text, keyed by the releases that have that text
    (``"current"`` required; a release left out does not have the operator). `namespace` is the torch.library
    namespace install() defines it in: "npu", or "atb" for the ATB operators (torch.ops.atb.*). `renamed` maps a
    cann_attn parameter name to the torch_npu one it is passed as (``{"layout": "layout_query"}``): errors naming
    the first name the second, as the caller spelled it."""

    parsed = {release: parse_schema(text) for releases, text in schemas.items() for release in releases}
    if CURRENT not in parsed or any(r not in RELEASES for r in parsed):
        raise ValueError(f"schemas: expected releases among {RELEASES} including {CURRENT!r}, got {list(parsed)}")

    def register(impl: Callable) -> Callable:
        impl = _typed_errors(keywords_checked(impl), renamed or {})
        op = NpuOp(impl.__name__, impl, parsed, namespace=namespace)

        def run(*args, **kwargs):
            release = _active["release"]
            if release == CURRENT or release not in op.schemas:
                return impl(*args, **kwargs)
            return _call_as(op, op.schemas[release], release, args, kwargs)

        @functools.wraps(impl)
        def call(*args, **kwargs):
            if CALL_HOOKS:
                return CALL_HOOKS[-1](op, run, args, kwargs)
            return run(*args, **kwargs)

        op.wrapper = call
        OPS[op.name] = op
        _apply_signature(op, _active["release"])
        return call

    return register


# torch's own type check of a cann_attn custom op's arguments (a str where the schema says int, ...).
_SCHEMA_TYPE_ERROR = re.compile(r"^cann_attn::\w+\(\) Expected a value of type '(?P<expected>[^']+)' for argument "
                                r"'(?P<param>\w+)' but instead found type '(?P<found>[^']+)'")


def _typed_errors(impl: Callable, renamed: dict[str, str]) -> Callable:
    """`impl` whose errors are typed and name parameters as torch_npu spells them: an AclnnError about a parameter
    of `renamed` (cann_attn name -> torch_npu name) names the torch_npu one, and torch's type check of a cann_attn
    custom op's argument becomes a ParamInvalidError naming that argument (docs/semantics/errors.md)."""

    @functools.wraps(impl)
    def call(*args, **kwargs):
        try:
            return impl(*args, **kwargs)
        except AclnnError as exc:
            for ours, theirs in renamed.items():
                if exc.message.startswith(f"{ours}:"):
                    raise type(exc)(theirs + exc.message[len(ours):]) from None
            raise
        except RuntimeError as exc:
            match = _SCHEMA_TYPE_ERROR.match(str(exc))
            if match is None:
                raise
            param = renamed.get(match["param"], match["param"])
            raise ParamInvalidError(f"{param}: expected {match['expected']}, got a {match['found']}") from None

    return call


def _call_as(op: NpuOp, schema: Schema, release: str, args: tuple, kwargs: dict):
    """Call the implementation as torch_npu ``release`` would: its parameters, its defaults, its outputs."""
    names = [p.name for p in schema.params]
    if len(args) > schema.positional_count:
        raise TypeError(f"{op.name}() takes {schema.positional_count} positional arguments in torch_npu {release} "
                        f"but {len(args)} were given")
    for name in kwargs:
        if name not in names:
            raise unknown_keyword(op.name, name, names, f"torch_npu {release}")
    current = {p.name: p for p in op.schemas[CURRENT].params}
    for index, param in enumerate(schema.params):
        if index < len(args) or param.name in kwargs or param.default is inspect.Parameter.empty:
            continue
        if param.name in current and current[param.name].default != param.default:
            kwargs[param.name] = param.default  # e.g. 7.2's npu_prompt_flash_attention pre_tokens=2147473647
    out = op.impl(*args, **kwargs)
    arity = len(schema.returns)
    if isinstance(out, tuple) and len(out) > arity:
        return out[:arity]
    return out


def _release_from_environment() -> None:
    value = os.environ.get(RELEASE_ENV)
    if value:
        use_release(value)
