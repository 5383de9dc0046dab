"""The torch_npu runtime around the operators after install(device="cpu") (docs/guides/torch_npu.md): TorchScript
and distribution metadata, torch_npu.npu's runtime names, AMP, transfer_to_npu, and two unedited distributed
programs. Each case runs in a fresh interpreter (tests/torch_npu_runtime_cases.py)."""

from __future__ import annotations

import torch_npu_runtime_cases as cases


def test_scripted_factories_metadata_all_or_nothing_install_and_uninstall(tmp_path):
    cases.run_case(cases.SCRIPTING_AND_METADATA, "cpu", tmp_path)


def test_runtime_names_device_properties_generator_streams_and_mixed_backends(tmp_path):
    cases.run_case(cases.RUNTIME_NAMES, "cpu", tmp_path)


def test_npu_amp_autocast_dtype_and_grad_scaler_steps_skips_and_backs_off(tmp_path):
    cases.run_case(cases.AMP, "cpu", tmp_path)


def test_transfer_to_npu_sends_cuda_code_to_the_target(tmp_path):
    cases.run_case(cases.TRANSFER_TO_NPU, "cpu", tmp_path)


def test_unedited_ulysses_npu_test_runs_to_its_end_on_two_ranks():
    """yunchang's NPU Ulysses test pattern (hccl, npu:{rank}, npu_fusion_attention_v2, module-level scripted
    helpers) with only the install line added: output and gradients equal the whole-sequence call."""
    assert "ulysses ok on 2 ranks, device cpu" in cases.run_program("ulysses_npu.py", 2)


def test_unedited_mindspeed_style_ring_attention_runs_to_its_end_on_two_ranks():
    """CUDA-spelled ring attention made NPU code by transfer_to_npu (nccl, .cuda(), isend/irecv,
    npu_ring_attention_update) with only the install line added."""
    assert "ring attention ok" in cases.run_program("mindspeed_ring_attention.py", 2)


def test_transfer_train_example_runs_and_is_the_one_the_guide_shows():
    script = cases.ROOT / "examples" / "transfer_train.py"
    body = script.read_text().split('"""', 2)[2].strip()
    assert body in (cases.ROOT / "docs" / "guides" / "torch_npu.md").read_text(), \
        "docs/guides/torch_npu.md shows another version of examples/transfer_train.py"
    output = cases.run_example(script, "--steps", "4")
    assert output.splitlines()[-1].startswith("4 of 4 steps taken on cpu"), output
    losses = [float(line.split()[3]) for line in output.splitlines() if line.startswith("step ")]
    assert len(losses) == 4 and losses[-1] < losses[0]
