"""Smoke tests for examples/train_dsa.py (tiny DSA training on the CPU)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_dsa.py"


@pytest.fixture(scope="module")
def train_dsa():
    spec = importlib.util.spec_from_file_location("train_dsa_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops: one thread is faster, and far faster when other processes compete for the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_main_runs_both_stages(train_dsa, tmp_path):
    summary = train_dsa.main(["--steps-dense", "3", "--steps-sparse", "3", "--seed", "1", "--out", str(tmp_path),
                              "--no-progress"])
    history = summary["history"]
    assert len(history["lm"]) == len(history["kl"]) == 6
    assert all(math.isfinite(v) for v in history["lm"] + history["kl"])
    assert all(v >= 0 for v in history["kl"])
    assert summary["steps"] == {"dense": 3, "sparse": 3, "total": 6}
    evaluation = summary["evaluation"]
    assert math.isfinite(evaluation["val_lm_dense"]) and math.isfinite(evaluation["val_lm_sparse"])
    assert (tmp_path / "train_dsa.png").stat().st_size > 0
    saved = json.loads((tmp_path / "train_dsa.json").read_text())
    assert saved["lm_loss"]["initial"] == pytest.approx(sum(history["lm"]) / 6)


def test_training_is_reproducible(train_dsa):
    cfg = train_dsa.Config(batch_size=2, seq_len=64, steps_dense=2, steps_sparse=2, seed=3)
    first = train_dsa.train(cfg, out_dir=None, progress=False)["history"]
    second = train_dsa.train(cfg, out_dir=None, progress=False)["history"]
    assert first == second


def test_sparse_path_matches_dense_path_when_top_k_covers_all_keys(train_dsa):
    """With K >= S the indexer selects every causal key: sparse MLA must reproduce the dense flash_attention path,
    and the library's indexer KL (sparse stage) the example's plain-torch dense KL (warm-up stage)."""
    cfg = train_dsa.Config(batch_size=2, seq_len=32, top_k=32, seed=0)
    torch.manual_seed(0)
    model = train_dsa.TinyDSA(cfg).double()
    model.rope = train_dsa.Rope(*(t.double() for t in (model.rope.cos, model.rope.sin, model.rope.cos_idx,
                                                        model.rope.sin_idx)))
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    results = {}
    for sparse in (False, True):
        model.zero_grad()
        lm, kl = model(tokens[:, :-1], tokens[:, 1:], sparse=sparse)
        (lm + kl).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[sparse] = (lm.detach(), kl.detach(), grads)
    (lm_d, kl_d, g_d), (lm_s, kl_s, g_s) = results[False], results[True]
    torch.testing.assert_close(lm_s, lm_d)
    torch.testing.assert_close(kl_s, kl_d)
    assert g_d.keys() == g_s.keys()
    for name in g_d:
        torch.testing.assert_close(g_s[name], g_d[name], msg=name)
