"""On a GPU: the fast path equals the plain one, and a run on CUDA gives the CPU's numbers
(float tolerance). Marked ``cuda``: skipped without a GPU (tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_speed import CASES, rounds, trainer

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("case", ["dfedem (fused SGD update)", "fedli_ls (line search)"])
def test_fused_path_equals_plain_path_on_cuda(case, tmp_path):
    fused = rounds(trainer(tmp_path, "auto", CASES[case], device="cuda"))
    plain = rounds(trainer(tmp_path, "vmap", CASES[case], device="cuda"))
    assert fused.device.type == "cuda"
    np.testing.assert_allclose(fused.shared_parameters(), plain.shared_parameters(),
                               rtol=1e-4, atol=1e-5)  # fmt: skip


def test_cuda_run_equals_cpu_run(tmp_path):
    """The same config on both devices (TF32 off, deterministic kernels): the summaries
    agree to float tolerance."""
    case = CASES["dfedem (fused SGD update)"]
    on_gpu = trainer(tmp_path / "gpu", "auto", case, device="cuda")
    on_cpu = trainer(tmp_path / "cpu", "auto", case, device="cpu")
    gpu, cpu = on_gpu.run(), on_cpu.run()
    assert gpu["test_accuracy"] == pytest.approx(cpu["test_accuracy"], abs=1e-3)
    assert gpu["train_loss"] == pytest.approx(cpu["train_loss"], rel=1e-4)
    np.testing.assert_allclose(on_gpu.shared_parameters(), on_cpu.shared_parameters(),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    assert torch.cuda.is_available()
