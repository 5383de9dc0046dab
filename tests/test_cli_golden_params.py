"""``cann-attn golden`` never drops a parameter, and computes paged goldens.

- Every parameter of every operator ``golden`` knows (walked from the public signatures) has one role: handed to
  the float64 oracle (its name, after the operator's renames, is a parameter of that oracle), read by the golden
  itself, documented as without effect, or refused: a case that sets a refused parameter exits with status 2 and
  one line naming it, a grad case whose forward statistics are not those of its inputs likewise.
- Paged caches (FIA / IFA ``block_table`` + ``block_size``, SFA / LI ``PA_BSND``): the golden equals an independent
  float64 computation (the pages gathered here, position by position, then the contiguous oracle), the operator's
  outputs pass ``compare``, an NPU-like perturbation of them passes, and a real error fails.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from cann_attn.cli import cases as registry
from cann_attn.cli import tensorio
from cann_attn.testing.dsa_oracle import lightning_indexer_oracle, sparse_attention_oracle
from cann_attn.testing.fia_oracle import fia_oracle
from cli_utils import run_main

ROOT = Path(__file__).resolve().parents[1]
PAGED = {p.stem: p for p in (ROOT / "examples" / "cases").glob("*_paged.json")}


# ------------------------------------------------------------------------------------------------------
# Every parameter: passed, read, without effect, or refused
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", sorted(registry.OPERATORS))
def test_every_parameter_has_a_role(op):
    record = registry.OPERATORS[op]
    params = registry.op_signature(op).parameters
    roles = record.roles()
    assert list(roles) == list(params)
    oracle_params = inspect.signature(record.oracle).parameters
    for name, role in roles.items():
        assert role.split(":")[0] in ("oracle", "golden", "no effect", "refused"), (name, role)
        if role == "oracle":
            assert record.renames.get(name, name) in oracle_params, name
        else:
            assert record.renames.get(name, name) not in oracle_params or name in record.consumed, name


@pytest.mark.parametrize(
    ("op", "name"),
    [(op, n) for op, rec in sorted(registry.OPERATORS.items()) for n, r in rec.roles().items()
     if r.startswith("refused")],
)
def test_a_refused_parameter_is_named(op, name):
    """`check` refuses every parameter the golden would drop, when set (a tensor, or a non-default scalar)."""
    record = registry.OPERATORS[op]
    default = registry.op_signature(op).parameters[name].default
    value = torch.zeros(1) if default is None else (not default if isinstance(default, bool) else 7)
    record.check({})  # the defaults pass
    with pytest.raises(registry.UnsupportedParameter, match=rf"^{name}: the golden of {op}"):
        record.check({name: value})


def test_golden_refuses_a_dropped_parameter_with_one_line(tmp_path, capsys):
    """FIA v2 quant_scale_p (reserved) has no float64 oracle: golden exits 2 naming it (not silently ignored)."""
    case = {
        "op": "fused_infer_attention_score_v2",
        "inputs": {"query": {"shape": [1, 2, 1, 16], "dtype": "float16"},
                   "key": {"shape": [1, 2, 8, 16], "dtype": "float16"},
                   "value": {"shape": [1, 2, 8, 16], "dtype": "float16"},
                   "quant_scale_p": {"shape": [1], "dtype": "float32"}},
        "params": {"num_query_heads": 2, "input_layout": "BNSD", "softmax_scale": 0.25},
    }
    path = tmp_path / "case.json"
    path.write_text(json.dumps(case))
    rc, _, err = run_main(capsys, "golden", "--case", path, "--out", tmp_path / "g")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "inputs.quant_scale_p: the golden of fused_infer_attention_score_v2 does not take" in err
    assert not (tmp_path / "g").exists()


def test_golden_refuses_grad_state_of_another_forward(tmp_path, capsys):
    """A grad golden differentiates the forward of its inputs: softmax_max drawn at random is refused (exit 2)."""
    case = json.loads((ROOT / "examples" / "cases" / "flash_attention_score_grad.json").read_text())
    derived = tmp_path / "derived"
    path = tmp_path / "case.json"
    path.write_text(json.dumps(case))
    assert run_main(capsys, "golden", "--case", path, "--out", derived)[0] == 0
    # the derived statistics given back as inputs are accepted ...
    rc, out, err = run_main(capsys, "golden", "--case", path, "--out", tmp_path / "again", "--inputs",
                         derived / "softmax_max.npy", derived / "softmax_sum.npy", derived / "attention_in.npy")
    assert rc == 0, out + err
    # ... others are not
    shape = tensorio.read_npy(derived / "softmax_max.npy").shape
    case["inputs"]["softmax_max"] = {"shape": list(shape), "dtype": "float32"}
    path.write_text(json.dumps(case))
    rc, _, err = run_main(capsys, "golden", "--case", path, "--out", tmp_path / "bad")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "inputs.softmax_max: differs from the forward's" in err


# ------------------------------------------------------------------------------------------------------
# Paged goldens: equal to an independent float64 computation; the round trip through compare
# ------------------------------------------------------------------------------------------------------
def _gather(cache: torch.Tensor, table: torch.Tensor, lengths: list[int], block_size: int) -> list[torch.Tensor]:
    """Sequence b's keys, position by position (cache [block_num, block_size, ...])."""
    return [torch.stack([cache[int(table[b, p // block_size]), p % block_size] for p in range(n)])
            for b, n in enumerate(lengths)]


def _padded(seqs: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(seqs), width, *seqs[0].shape[1:], dtype=seqs[0].dtype)
    for b, s in enumerate(seqs):
        out[b, : len(s)] = s
    return out


def _expected(op: str, t: dict[str, torch.Tensor], params: dict) -> dict[str, torch.Tensor]:
    """The float64 goldens of the example's call, from contiguous keys gathered here."""
    table = t["block_table"]
    if op in ("fused_infer_attention_score", "incre_flash_attention"):
        lengths = params.get("actual_seq_lengths_kv") or params["actual_seq_lengths"]
        bs, width = params["block_size"], table.shape[1] * params["block_size"]
        kv = {}
        for name in ("key", "value"):
            cache = t[name]
            if cache.dim() == 4:  # BnNBsD -> [block_num, block_size, N, D]
                cache = cache.permute(0, 2, 1, 3)
            dense = _padded(_gather(cache, table, lengths, bs), width)  # [B, S, H] or [B, S, N, D]
            kv[name] = dense.permute(0, 2, 1, 3) if params["input_layout"] == "BNSD" else dense
        out, lse = fia_oracle(t["query"], kv["key"], kv["value"], num_heads=params["num_heads"],
                              num_key_value_heads=params["num_key_value_heads"], input_layout=params["input_layout"],
                              scale=params.get("scale", params.get("scale_value")), actual_seq_lengths_kv=lengths,
                              softmax_lse_flag=params.get("softmax_lse_flag", False))
        return {"attention_out": out} | ({} if lse is None else {"softmax_lse": lse})
    lengths_name = "actual_seq_lengths_kv" if op == "sparse_flash_attention" else "actual_seq_lengths_key"
    lengths = params[lengths_name]
    caches = ("key", "value", "key_rope") if op == "sparse_flash_attention" else ("key_index",)
    bs = t[caches[0]].shape[1]
    kv = {n: _padded(_gather(t[n], table, lengths, bs), table.shape[1] * bs) for n in caches}
    if op == "sparse_flash_attention":
        out, smax, ssum = sparse_attention_oracle(
            t["query"], kv["key"], kv["value"], t["sparse_indices"], params["scale_value"],
            query_rope=t["query_rope"], key_rope=kv["key_rope"], layout="BSND", sparse_mode=params["sparse_mode"],
            actual_seq_lengths_query=params["actual_seq_lengths_query"], actual_seq_lengths_kv=lengths,
            sparse_block_size=params["sparse_block_size"])
        return {"attention_out": out, "softmax_max": smax, "softmax_sum": ssum}
    indices, _ = lightning_indexer_oracle(
        t["query_index"], kv["key_index"], t["weights"], layout="BSND", sparse_mode=params["sparse_mode"],
        sparse_count=params["sparse_count"], actual_seq_lengths_query=params["actual_seq_lengths_query"],
        actual_seq_lengths_key=lengths)
    return {"sparse_indices": indices}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    manifest = tensorio.read_manifest(directory)
    return {e["name"]: tensorio.read_entry(directory, e) for e in manifest["tensors"]}


def _rewrite(source: Path, target: Path, change) -> None:
    """A copy of an ACTUAL directory with every output passed through `change`."""
    manifest = tensorio.read_manifest(source)
    target.mkdir()
    entries = []
    for entry in manifest["tensors"]:
        t = change(entry["name"], tensorio.read_entry(source, entry))
        entries.append(tensorio.write_tensor(target, entry["name"], t, entry["role"], source="perturbed"))
    tensorio.write_manifest(target, {**manifest, "tensors": entries})


def _npu_like(name: str, t: torch.Tensor) -> torch.Tensor:
    """One element in fifty rounded the other way (one ulp up or down), as a kernel accumulating in another order
    does near a rounding boundary; sentinels (|x| > 1e30) and integers unchanged."""
    if not t.dtype.is_floating_point:
        return t
    gen = torch.Generator().manual_seed(0)
    pick = (torch.rand(t.shape, generator=gen) < 0.02) & (t.abs() < 1e30)
    toward = torch.where(torch.rand(t.shape, generator=gen) < 0.5, float("inf"), float("-inf")).to(t.dtype)
    moved = torch.where(pick, torch.nextafter(t, toward), t)
    assert int((moved != t).sum()) == int(pick.sum())
    return moved


def _broken(name: str, t: torch.Tensor) -> torch.Tensor:
    """A kernel off by 2% everywhere (a wrong index: one entry)."""
    if t.dtype.is_floating_point:
        return (t.double() * 1.02 + 0.02).to(t.dtype)
    t = t.clone()
    t.view(-1)[0] += 1
    return t


def test_paged_fia_golden_reads_the_block_table(tmp_path, capsys):
    """The issue's report: a block_table given as values was dropped (exit 0, attention_out off by up to 1)."""
    case = {
        "op": "fused_infer_attention_score", "seed": 1,
        "inputs": {"query": {"shape": [2, 1, 64], "dtype": "float32"},
                   "key": {"shape": [3, 16, 32], "dtype": "float32"},
                   "value": {"shape": [3, 16, 32], "dtype": "float32"},
                   "block_table": {"generator": "values", "values": [[2, 0], [1, -1]], "dtype": "int32"}},
        "params": {"num_heads": 4, "num_key_value_heads": 2, "input_layout": "BSH", "scale": 0.25, "block_size": 16,
                   "actual_seq_lengths_kv": [20, 9], "softmax_lse_flag": True},
    }
    path = tmp_path / "case.json"
    path.write_text(json.dumps(case))
    rc, out, err = run_main(capsys, "golden", "--case", path, "--out", tmp_path / "g")
    assert rc == 0, out + err
    written = _tensors(tmp_path / "g")
    for name, want in _expected(case["op"], written, case["params"]).items():
        assert torch.allclose(written[name].double(), want, rtol=1e-6, atol=1e-6), name


@pytest.mark.parametrize("example", sorted(PAGED))
def test_paged_golden_round_trip(example, tmp_path, capsys):
    case = json.loads(PAGED[example].read_text())
    golden, actual = tmp_path / "golden", tmp_path / "actual"
    rc, out, err = run_main(capsys, "golden", "--case", PAGED[example], "--out", golden, "--actual", actual)
    assert rc == 0, out + err
    written = _tensors(golden)
    assert written["block_table"].dtype == torch.int32
    expected = _expected(case["op"], written, case["params"])
    for name, want in expected.items():
        got = written[name]
        assert torch.equal(got, want.to(got.dtype)), name
    rc, out, err = run_main(capsys, "compare", actual, golden)
    assert rc == 0 and f"PASS: {len(expected)}/{len(expected)}" in out, out + err
    _rewrite(actual, tmp_path / "npu", _npu_like)
    rc, out, err = run_main(capsys, "compare", tmp_path / "npu", golden)
    assert rc == 0, out + err
    _rewrite(actual, tmp_path / "wrong", _broken)
    rc, out, err = run_main(capsys, "compare", tmp_path / "wrong", golden)
    assert rc == 1 and "FAIL" in out, out + err


def test_verify_runs_the_paged_cases(capsys):
    rc, out, err = run_main(capsys, "verify", "--case", "paged", "--json", "-")
    report = json.loads(out)
    assert rc == 0 and report["passed"], err
    ops = {row["op"] for row in report["outputs"]}
    assert ops == {"fused_infer_attention_score", "fused_infer_attention_score_v2", "incre_flash_attention",
                   "sparse_flash_attention", "lightning_indexer", "quant_lightning_indexer",
                   "kv_quant_sparse_flash_attention"}


# ------------------------------------------------------------------------------------------------------
# One module per operator family: its cases beside its golden rule
# ------------------------------------------------------------------------------------------------------
def test_each_family_module_holds_its_cases_and_its_golden():
    """Every operator's golden rule and its verify cases come from the same family module of cli/cases/ (none
    from the shared _common), and every family module of the package is imported (registered)."""
    import importlib
    import pkgutil

    package = importlib.import_module("cann_attn.cli.cases")
    modules = {m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")}
    assert set(registry.FAMILIES) == modules and {"fa", "fa_grad", "pfa", "fia", "dsa", "merge"} <= modules
    for op, record in registry.OPERATORS.items():
        family = record.golden.__module__
        assert family.startswith("cann_attn.cli.cases.") and not family.endswith("._common"), (op, family)
        builders = {getattr(case.build, "func", case.build).__module__ for case in registry.CASES if case.op == op}
        assert builders <= {family}, (op, family, builders)
