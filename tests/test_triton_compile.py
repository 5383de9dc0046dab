"""The Triton kernels compile for sm_90 (Hopper) ahead of time, and fit its shared memory.

No GPU needed: `cann_attn.backends.triton.aot` records the launches of a representative set of op calls (with the
host code taking its GPU decisions) in an interpreter subprocess, then compiles specializations with
`triton.compile` for GPUTarget("cuda", 90, 32) through the bundled ptxas in a TRITON_INTERPRET=0 subprocess. CI
compiles one representative specialization per kernel (the most feature flags, the widest head dims: DSA at
N1=128, latent 512, rope 64) with the config a launch takes first; benchmarks/kernel_report.py compiles every
specialization and autotune config (minutes of ptxas) and reports registers and spills.
"""

from __future__ import annotations

import pytest

from cann_attn.backends.triton import aot

pytest.importorskip("triton")
_MISSING = aot.toolchain_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"no sm_90 AOT toolchain: {_MISSING}")


@pytest.fixture(scope="module")
def specs() -> list[aot.KernelSpec]:
    return aot.record_subprocess()


@pytest.fixture(scope="module")
def results(specs: list[aot.KernelSpec]) -> list[aot.CompileResult]:
    return aot.compile_subprocess(aot.representative(specs), all_configs=False)


def test_recording_covers_every_kernel_variant(specs: list[aot.KernelSpec]) -> None:
    kernels = {s.kernel for s in specs}
    assert kernels == {"_forward_kernel", "_delta_kernel", "_dkdv_kernel", "_dq_kernel", "_sfa_fwd_kernel",
                       "_sfa_bwd_kernel", "_segment_sum_kernel", "_index_keys_kernel", "_kl_prepare_kernel",
                       "_kl_grad_kernel"}
    dense = [s.constexprs for s in specs if s.kernel == "_forward_kernel"]
    assert {c["PSE_KIND"] for c in dense} == {0, 1, 2, 3}
    assert any(c["COMPRESSED"] for c in dense) and any(c["HAS_DROP"] for c in dense)
    assert any(c["HAS_MASK"] for c in dense) and any(c["GROUP"] > 1 for c in dense)
    assert any(c["DV"] < c["DQK"] for c in dense)
    assert {c["UPCAST"] for c in dense} == {False}  # GPU decisions, not the interpreter's
    bwd = [s.constexprs for s in specs if s.kernel == "_sfa_bwd_kernel"]
    assert {c["DETERMINISTIC"] for c in bwd} == {False, True} and {c["HAS_ROPE"] for c in bwd} == {False, True}
    assert any(s.autotuned and len(s.configs) > 1 for s in specs)


def test_every_kernel_compiles_for_sm90_within_its_shared_memory(results: list[aot.CompileResult]) -> None:
    assert {r.kernel for r in results} >= {"_forward_kernel", "_dkdv_kernel", "_dq_kernel", "_sfa_fwd_kernel",
                                           "_sfa_bwd_kernel", "_kl_prepare_kernel", "_kl_grad_kernel"}
    failures = [f"{r.spec} | {r.config}: {r.error[:500]}" for r in results if not r.ok]
    assert not failures, "\n".join(failures)
    assert all(r.smem >= 0 and r.regs > 0 for r in results)
    # A launch over the limit fails on the GPU (OutOfResources); DSA's 512-wide heads made two kernels do so.
    over = [f"{r.spec} | {r.config}: {r.smem // 1024} KB" for r in results if r.over_smem]
    assert not over, "over Hopper's 227 KB of shared memory per block:\n" + "\n".join(over)
