"""Every Triton kernel specialization that real op calls launch compiles for sm_90 (Hopper) ahead of time.

No GPU needed: `cann_attn.backends.triton.aot` records the launches of a representative set of op calls (with the
host code taking its GPU decisions) in an interpreter subprocess, then compiles each specialization with
`triton.compile` for GPUTarget("cuda", 90, 32) through the bundled ptxas in a TRITON_INTERPRET=0 subprocess.
Compiled kernels land in Triton's cache (TRITON_CACHE_DIR or ~/.triton/cache), so only the first run pays for
ptxas (about 8 minutes on 2 cores; warm runs take seconds). Register / spill / shared-memory figures are
reported by benchmarks/kernel_report.py, not asserted here.
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
    # Every spec with its default (first) config, and every config of each kernel's autotune list once.
    return aot.compile_subprocess(aot.select_configs(specs))


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


def test_every_specialization_compiles_for_sm90(results: list[aot.CompileResult]) -> None:
    failures = [f"{r.spec} | {r.config}: {r.error[:500]}" for r in results if not r.ok]
    assert not failures, "\n".join(failures)
    assert all(r.smem >= 0 and r.regs > 0 for r in results)
