"""The ``cann-attn`` command line, run as a subprocess (the installed console script when present)."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli_utils import run_main
from patience import HANG_SECONDS


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "cann-attn"
    if script.exists():
        return [str(script)]
    found = shutil.which("cann-attn")
    return [found] if found else [sys.executable, "-m", "cann_attn.cli.main"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*_cli(), *args], capture_output=True, text=True, timeout=timeout)


def test_help():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    assert "verify" in proc.stdout and "bench" in proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["no-such-command"],
        [],
        ["verify", "--op", "no_such_op"],
        ["verify", "--bogus"],
        ["verify", "--seed", "99999999999999999999", "--list"],  # over 64 bits: torch's seeds overflow
        ["verify", "--seed", "-9223372036854775809", "--list"],
        ["verify", "--seed", "abc"],
    ],
)
def test_bad_usage_exits_2_with_one_line(args):
    proc = _run(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cann-attn: error:"), proc.stderr


def test_verify_quick_flash_attention_score():
    proc = _run("verify", "--quick", "--op", "flash_attention_score", timeout=HANG_SECONDS)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "flash_attention_score" in proc.stdout and "OK" in proc.stdout


@pytest.mark.parametrize("fault", ["bf16_statistics", "one_nan"])
def test_verify_fails_undocumented_dtypes_and_nans(fault, monkeypatch, capsys):
    """An operator returning its softmax statistics in bf16 (documented: fp32), or one NaN in an output, fails
    verify, though the Ascend rule alone (golden cast to the actual's dtype; t * numel allowance) would pass it."""
    import cann_attn
    from cann_attn.cli import main as cli_main

    real = cann_attn.flash_attention_score

    @functools.wraps(real)  # the CLI reads (and caches) the operator's signature
    def faulty(*args, **kwargs):
        out, smax, ssum, soft = real(*args, **kwargs)
        if fault == "bf16_statistics":
            return type(real(*args, **kwargs))(out, smax.bfloat16(), ssum.bfloat16(), soft)
        out = out.clone()
        out.view(-1)[0] = float("nan")
        return type(real(*args, **kwargs))(out, smax, ssum, soft)

    monkeypatch.setattr(cann_attn, "flash_attention_score", faulty)
    monkeypatch.setenv("COLUMNS", "250")  # the whole note in the table
    rc = cli_main.main(["verify", "--quick", "--op", "flash_attention_score", "--case", "bsnd"])
    out = capsys.readouterr().out
    assert rc == 1
    assert ("dtype bfloat16 != expected float32" if fault == "bf16_statistics" else "NaN/inf values") in out


def test_verify_names_the_backend_of_each_case():
    proc = _run("verify", "--quick", "--op", "flash_attention_score", "--case", "gqa", "--backend", "reference")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "backend reference" in proc.stdout
    table = [line.split() for line in proc.stdout.splitlines() if line.startswith("flash_attention_score ")]
    assert table and all("reference" in row for row in table), proc.stdout


def test_verify_list():
    proc = _run("verify", "--list")
    assert proc.returncode == 0, proc.stderr
    assert "doc_example" in proc.stdout


def _fake_benchmarks(tmp_path: Path) -> dict[str, str]:
    """A benchmarks folder with a CPU suite that succeeds and a GPU-only suite that fails without CUDA."""
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "bench_cpu_case.py").write_text("print('cpu suite ran')\n")
    (folder / "bench_gpu_case.py").write_text("import sys\nprint('gpu suite ran')\nsys.exit(2)\n")
    return {**os.environ, "CANN_ATTN_BENCHMARKS": str(folder)}


def test_bench_all_skips_gpu_only_suites_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the GPU suites run")
    env = _fake_benchmarks(tmp_path)
    proc = subprocess.run([*_cli(), "bench"], capture_output=True, text=True, timeout=HANG_SECONDS, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cpu suite ran" in proc.stdout and "gpu suite ran" not in proc.stdout
    assert "skipped (no CUDA device" in proc.stdout and "gpu_case" in proc.stdout


def test_bench_named_suite_reports_its_failure(tmp_path):
    env = _fake_benchmarks(tmp_path)
    proc = subprocess.run([*_cli(), "bench", "--suite", "gpu_case"], capture_output=True, text=True,
                          timeout=HANG_SECONDS, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "gpu suite ran" in proc.stdout and "exit status 2" in proc.stderr


def _device_benchmarks(tmp_path: Path) -> dict[str, str]:
    """Suites that print the options they get: one that declares DEVICES = ("cpu",), one that declares
    ("cuda",), and one without DEVICES (and without a --device option)."""
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    template = (
        "import argparse\n{devices}"
        "p = argparse.ArgumentParser()\n{device_option}"
        "p.add_argument('--quick', action='store_true')\n"
        "p.add_argument('--out')\n"
        "print('{name} ran with', vars(p.parse_args()))\n"
    )
    for name, devices in (("cpu_case", '("cpu",)'), ("gpu_case", '("cuda",)'), ("plain_case", None)):
        (folder / f"bench_{name}.py").write_text(
            template.format(
                name=name,
                devices=f"DEVICES = {devices}\n" if devices else "",
                device_option="p.add_argument('--device', choices=DEVICES)\n" if devices else "",
            )
        )
    return {**os.environ, "CANN_ATTN_BENCHMARKS": str(folder)}


def _bench(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_cli(), "bench", *args], capture_output=True, text=True, timeout=HANG_SECONDS, env=env)


def _one_line_usage_error(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cann-attn: error:") and message in lines[0], proc.stderr
    assert " ran with" not in proc.stdout, "no suite may run"


def test_bench_passes_device_only_to_suites_that_take_it(tmp_path):
    env = _device_benchmarks(tmp_path)
    proc = _bench(env, "--suite", "cpu_case", "--device", "cpu", "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cpu_case ran with {'device': 'cpu', 'quick': True" in proc.stdout
    proc = _bench(env, "--suite", "plain_case", "--device", "cpu")  # takes no --device: runs on the CPU without it
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plain_case ran with {'quick': False" in proc.stdout
    proc = _bench(env, "--device", "cpu")  # all: the suites that run on the CPU
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cpu_case ran" in proc.stdout and "plain_case ran" in proc.stdout and "gpu_case ran" not in proc.stdout
    assert "skipped (they do not run on cpu): gpu_case" in proc.stdout
    _one_line_usage_error(_bench(env, "--suite", "gpu_case", "--device", "cpu"), "suite gpu_case runs on cuda only")
    _one_line_usage_error(_bench(env, "--suite", "cpu_case", "--device", "cuda"), "suite cpu_case runs on cpu only")


def test_bench_device_cuda_without_cuda_is_a_usage_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    env = _device_benchmarks(tmp_path)
    _one_line_usage_error(_bench(env, "--device", "cuda"), "--device cuda: CUDA is not available")
    _one_line_usage_error(_bench(env, "--suite", "gpu_case", "--device", "cuda"), "CUDA is not available")


@pytest.mark.parametrize("out", ["/dev/null/results", "{file}", "{file}/results"])
def test_bench_unwritable_out_is_a_usage_error_before_any_suite(tmp_path, out):
    env = _device_benchmarks(tmp_path)
    (tmp_path / "file").write_text("x")
    proc = _bench(env, "--suite", "cpu_case", "--out", out.format(file=tmp_path / "file"))
    _one_line_usage_error(proc, "--out: cannot write")


_PARSE_EACH_BENCHMARK = """
import contextlib, importlib.util, io, json, sys
from pathlib import Path
from cann_attn.cli import bench
result = {}
for name, script in bench.suites(Path(sys.argv[1])).items():
    devices, takes_device = bench.suite_devices(name, script)
    spec = importlib.util.spec_from_file_location("bench_" + name, script)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    codes = {}
    for device in ("cpu", "cuda"):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                module.main(["--device", device, "--help"])  # parsed, then --help exits before any work
            except SystemExit as exc:
                codes[device] = exc.code
    result[name] = {"declared": devices, "takes_device": takes_device, "module": list(module.DEVICES),
                    "exit": codes}
print(json.dumps(result))
"""


def test_real_benchmarks_take_the_devices_they_declare():
    """What cann-attn bench passes (--device among a script's DEVICES) is what that script's parser takes."""
    import json

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    proc = subprocess.run([sys.executable, "-c", _PARSE_EACH_BENCHMARK, str(folder)], capture_output=True,
                          text=True, timeout=HANG_SECONDS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"fa_forward", "fa_backward", "pfa", "indexer", "sparse_attention", "gpu_dense", "gpu_dsa",
            "sinks"} <= set(result)
    for name, r in result.items():
        assert r["takes_device"] and r["declared"] == r["module"], (name, r)
        assert r["exit"] == {d: 0 if d in r["declared"] else 2 for d in ("cpu", "cuda")}, (name, r)
    assert result["fa_forward"]["declared"] == result["fa_backward"]["declared"] == ["cpu", "cuda"]
    for name in ("pfa", "indexer", "sparse_attention", "sinks"):
        assert result[name]["declared"] == ["cpu"]
    for name in ("gpu_dense", "gpu_dsa"):
        assert result[name]["declared"] == ["cuda"]


# Output off a terminal (pipes, files, CI logs): plain text, numbers in full; --json for machines.

_SCI = re.compile(r"^-?\d\.\d\de[+-]\d\d$")


def test_plain_table_pads_columns_and_drops_markup():
    from cann_attn.cli.output import Column, plain_table

    lines = plain_table("title", [Column("name"), Column("value", "right")],
                        [["[green]a[/]", "1.23e-04"], ["longer name", "[red]-4.56e+01[/]"]])
    assert lines == ["title", "name" + " " * 13 + "value", "-----------  ---------",
                     "a" + " " * 13 + "1.23e-04", "longer name  -4.56e+01"]


def test_terminal_output_keeps_the_rich_table():
    from rich.console import Console

    from cann_attn.cli.output import Column, print_table

    terminal = Console(force_terminal=True, width=60, record=True)
    print_table(terminal, "title", [Column("name")], [["cell"]])
    assert "┃ name" in terminal.export_text()


@pytest.mark.parametrize("columns", ["40", "250"])
def test_verify_off_a_terminal_prints_every_number_in_full(columns, monkeypatch, capsys):
    """`cann-attn verify | cat`: however narrow the assumed width, no cell is cut or wrapped."""
    monkeypatch.setenv("COLUMNS", columns)
    rc, out, _ = run_main(capsys, "verify", "--quick", "--op", "prompt_flash_attention")
    assert rc == 0, out
    assert "…" not in out and "│" not in out and "\x1b[" not in out
    rows = [line.split() for line in out.splitlines() if line.startswith("prompt_flash_attention ")]
    assert len(rows) == 6  # one line per output, the case named on each
    for row in rows:
        numbers = [cell for cell in row if "e+" in cell or "e-" in cell]
        assert numbers and all(_SCI.match(cell) for cell in numbers), row
    assert out.splitlines()[-1].startswith("OK: 6 cases, 6 outputs")


def test_verify_json_on_stdout(capsys):
    rc, out, _ = run_main(capsys, "verify", "--quick", "--op", "lightning_indexer", "--json", "-")
    assert rc == 0
    report = json.loads(out)  # the whole of stdout is the JSON document
    assert report["passed"] is True and report["failing_cases"] == [] and report["cases"] >= 1
    outputs = report["outputs"]
    assert {o["op"] for o in outputs} == {"lightning_indexer"} and all(o["passed"] for o in outputs)
    assert {"sparse_indices", "loss"} & {o["output"] for o in outputs}
    for o in outputs:
        assert set(o) >= {"case", "output", "dtype", "max_abs", "max_rel", "ascend", "fa_rule", "backend", "note"}


def test_verify_json_file_reports_a_failure(monkeypatch, capsys, tmp_path):
    import cann_attn

    real = cann_attn.flash_attention_score

    @functools.wraps(real)
    def nan_output(*args, **kwargs):
        result = real(*args, **kwargs)
        out = result.attention_out.clone()
        out.view(-1)[0] = float("nan")
        return result._replace(attention_out=out)

    monkeypatch.setattr(cann_attn, "flash_attention_score", nan_output)
    report_path = tmp_path / "verify.json"
    rc, out, _ = run_main(capsys, "verify", "--quick", "--op", "flash_attention_score", "--case", "bsnd",
                       "--json", report_path)
    assert rc == 1 and "FAILED" in out  # the table still prints with a file target
    report = json.loads(report_path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert report["passed"] is False and report["failing_cases"]
    failing = [o for o in report["outputs"] if not o["passed"]]
    assert failing and all(o["output"] == "attention_out" and "NaN" in o["note"] for o in failing)


def test_verify_json_unwritable_is_a_usage_error(capsys, tmp_path):
    rc, _, err = run_main(capsys, "verify", "--quick", "--op", "lightning_indexer", "--json", tmp_path)
    assert rc == 2 and "--json" in err


@pytest.fixture
def fp16_golden(tmp_path, capsys):
    """A small FlashAttentionScore golden and cann_attn's own outputs for it."""
    case = {
        "op": "flash_attention_score", "seed": 0,
        "inputs": {"query": {"shape": [1, 32, 2, 16], "dtype": "float16"},
                   "key": {"shape": [1, 32, 2, 16], "dtype": "float16"},
                   "value": {"shape": [1, 32, 2, 16], "dtype": "float16"}},
        "params": {"head_num": 2, "input_layout": "BSND", "scale_value": 0.25},
    }
    (tmp_path / "case.json").write_text(json.dumps(case))
    rc, _, err = run_main(capsys, "golden", "--case", tmp_path / "case.json", "--out", tmp_path / "golden",
                       "--actual", tmp_path / "actual")
    assert rc == 0, err
    return tmp_path


def test_golden_and_compare_off_a_terminal_are_plain(fp16_golden, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "40")
    rc, out, _ = run_main(capsys, "golden", "--case", fp16_golden / "case.json", "--out", fp16_golden / "g2")
    assert rc == 0 and "┃" not in out and "generated: normal" in out
    rc, out, _ = run_main(capsys, "compare", fp16_golden / "actual", fp16_golden / "golden")
    assert rc == 0 and "…" not in out and "│" not in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("attention_out", "softmax"))}
    assert set(rows) == {"attention_out", "softmax_max", "softmax_sum"}
    for row in rows.values():
        assert _SCI.match(row[-3]) and _SCI.match(row[-2]) and row[-1] == "PASS", row  # MERE, MARE in full


def test_compare_json_on_stdout(fp16_golden, capsys):
    rc, out, _ = run_main(capsys, "compare", fp16_golden / "actual", fp16_golden / "golden", "--json", "-")
    assert rc == 0
    report = json.loads(out)
    assert report["passed"] is True and report["op"] == "flash_attention_score"
    tensors = {t["name"]: t for t in report["tensors"]}
    assert set(tensors) == {"attention_out", "softmax_max", "softmax_sum"}
    assert tensors["attention_out"]["threshold"] == 1e-3 and tensors["attention_out"]["passed"] is True

    bad = fp16_golden / "bad.npy"
    np.save(bad, np.load(fp16_golden / "actual" / "attention_out.npy") * np.float16(1.1))
    rc, out, _ = run_main(capsys, "compare", bad, fp16_golden / "golden" / "attention_out.npy", "--json", "-")
    assert rc == 1 and json.loads(out)["passed"] is False
