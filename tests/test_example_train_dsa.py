"""Smoke tests for examples/train_dsa.py (tiny DSA training on the CPU)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from example_modules import loaded_example

pytest.importorskip("matplotlib")

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def train_dsa():
    yield from loaded_example("train_dsa")


def test_main_runs_three_phases(train_dsa, tmp_path):
    summary = train_dsa.main(["--steps-dense", "3", "--steps-warmup", "2", "--steps-sparse", "3", "--seed", "1",
                              "--out", str(tmp_path), "--no-progress"])
    history = summary["history"]
    assert list(history) == ["dense", "warmup", "sparse"]
    assert [len(history[phase]["lm"]) for phase in history] == [3, 2, 3]
    assert [len(history[phase]["kl"]) for phase in history] == [3, 2, 3]
    values = [v for phase in history.values() for v in phase["lm"] + phase["kl"]]
    assert all(math.isfinite(v) for v in values)
    assert all(v >= 0 for phase in history.values() for v in phase["kl"])
    assert summary["steps"] == {"dense": 3, "warmup": 2, "sparse": 3, "total": 8}
    assert set(summary["lm_loss"]) == {"dense", "sparse"} and set(summary["kl_loss"]) == {"warmup", "sparse"}
    assert all(summary["time_seconds"][phase] > 0 for phase in history)
    evaluation = summary["evaluation"]
    assert math.isfinite(evaluation["val_lm_dense"]) and math.isfinite(evaluation["val_lm_sparse"])
    assert (tmp_path / "train_dsa.png").stat().st_size > 0
    saved = json.loads((tmp_path / "train_dsa.json").read_text())
    assert saved["lm_loss"]["dense"]["initial"] == pytest.approx(sum(history["dense"]["lm"]) / 3)
    assert saved["kl_loss"]["warmup"]["final"] == pytest.approx(sum(history["warmup"]["kl"]) / 2)


@pytest.mark.parametrize(("phase", "main_trained", "indexer_trained"),
                         [("dense", True, False), ("warmup", False, True), ("sparse", True, True)])
def test_each_phase_trains_only_its_part(train_dsa, monkeypatch, phase, main_trained, indexer_trained):
    """Phase 1 leaves the indexers at their initial weights, phase 2 freezes the main model, phase 3 trains both."""
    steps = {"steps_dense": 0, "steps_warmup": 0, "steps_sparse": 0, f"steps_{phase}": 2}
    cfg = train_dsa.Config(batch_size=2, seq_len=64, seed=5, **steps)
    models = []

    class Recorded(train_dsa.TinyDSA):
        def __init__(self, cfg):
            super().__init__(cfg)
            models.append(self)

    monkeypatch.setattr(train_dsa, "TinyDSA", Recorded)
    torch.manual_seed(cfg.seed)
    initial = {name: p.detach().clone() for name, p in train_dsa.TinyDSA(cfg).named_parameters()}
    train_dsa.train(cfg, out_dir=None, progress=False)
    trained = dict(models[-1].named_parameters())
    changed = {name: not torch.equal(trained[name], initial[name]) for name in initial}
    indexer = {name: value for name, value in changed.items() if ".indexer." in name}
    main = {name: value for name, value in changed.items() if ".indexer." not in name}
    assert indexer and main
    assert all(indexer.values()) if indexer_trained else not any(indexer.values())
    assert all(main.values()) if main_trained else not any(main.values())


def test_training_is_reproducible(train_dsa):
    cfg = train_dsa.Config(batch_size=2, seq_len=64, steps_dense=2, steps_warmup=2, steps_sparse=2, seed=3)
    first = train_dsa.train(cfg, out_dir=None, progress=False)["history"]
    second = train_dsa.train(cfg, out_dir=None, progress=False)["history"]
    assert first == second


def test_sparse_path_matches_dense_path_when_top_k_covers_all_keys(train_dsa):
    """With K >= S the indexer selects every causal key: sparse MLA must reproduce the dense flash_attention path,
    and the library's indexer KL (sparse phase) the example's plain-torch dense KL (warm-up phase)."""
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


def test_the_plot_is_skipped_without_matplotlib(train_dsa, monkeypatch, tmp_path, capsys):
    """matplotlib is optional (the `examples` extra): without it the run ends with a message, not a traceback."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    train_dsa.plot({}, train_dsa.Config(), tmp_path / "train_dsa.png")
    assert "matplotlib is not installed" in capsys.readouterr().out and not (tmp_path / "train_dsa.png").exists()
