"""Kernel choice per format and device (capability mocked); torchao.float8's native GEMM path,
which runs on a CPU too (torch._scaled_mm has a CPU implementation); torchao's block-scaled
(MX, NVFP4) path, whose GEMM has no CPU kernel: its operands are checked bit for bit through
torchao's emulated GEMM, and its dispatch up to torch's block-scaled GEMM call."""

from __future__ import annotations

import pytest
import torch

from lightning_snip import gemm as gemm_mod
from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.quantize import fake_quantize
from lightning_snip.gemm import Kernel, describe_kernels, kernel_for, quantized_matmul, torchao_block_mm
from lightning_snip.linear import SNIPLinear


def _mock_gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("capability,fp8_native,block_native", [
    ((8, 0), False, False), ((8, 6), False, False), ((8, 9), True, False), ((9, 0), True, False),
    ((10, 0), True, True), ((10, 3), True, True), ((12, 0), True, False)])
def test_kernel_choice_by_capability(monkeypatch, capability, fp8_native, block_native):
    _mock_gpu(monkeypatch, capability)
    cuda = torch.device("cuda", 0)
    assert kernel_for(Format.FP8, cuda) is (Kernel.TORCHAO_FP8 if fp8_native else Kernel.EMULATED)
    for fmt in (Format.MXFP8, Format.MXFP4, Format.NVFP4):  # torchao's block-scaled GEMMs: sm100 only
        assert kernel_for(fmt, cuda) is (Kernel.TORCHAO_BLOCK if block_native else Kernel.EMULATED)
    for fmt in (Format.FP8, Format.MXFP4):
        assert kernel_for(fmt, torch.device("cpu")) is Kernel.EMULATED  # CPUs emulate, whatever the GPU


def test_kernel_choice_without_cuda_and_the_setup_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernel_for(Format.FP8, torch.device("cuda", 0)) is Kernel.EMULATED
    assert kernel_for(Format.NVFP4, torch.device("cuda", 0)) is Kernel.EMULATED
    _mock_gpu(monkeypatch, (9, 0))
    line = describe_kernels([Format.BF16, Format.FP8, Format.MXFP4], torch.device("cuda", 0))
    assert line.startswith("fp8: native torchao kernel; mxfp4: emulated (cuda:0); a GEMM runs natively when")
    _mock_gpu(monkeypatch, (10, 0))
    line = describe_kernels([Format.FP8, Format.MXFP8, Format.NVFP4], torch.device("cuda", 0))
    assert line.startswith("fp8: native torchao kernel; mxfp8: native torchao block-scaled kernel; "
                           "nvfp4: native torchao block-scaled kernel (cuda:0); a GEMM runs natively when")
    assert describe_kernels([Format.MXFP4], torch.device("cpu")) == "mxfp4: emulated (cpu)"


def test_setup_names_the_layers_a_native_kernel_does_not_take(monkeypatch, caplog):
    from lightning_snip.config import SNIPConfig
    from lightning_snip.controller import log_setup

    layers = {"ok": SNIPLinear(64, 96), "odd": SNIPLinear(64, 40), "nv": SNIPLinear(48, 64),
              "head": SNIPLinear(64, 50)}
    layers["head"].pinned = Format.BF16  # pinned to another format: never runs fp8, not named
    assert gemm_mod.emulated_layers([Format.FP8, Format.NVFP4], torch.device("cpu"), layers) == {}
    _mock_gpu(monkeypatch, (10, 0))
    cuda = torch.device("cuda", 0)
    found = gemm_mod.emulated_layers([Format.BF16, Format.FP8, Format.MXFP4, Format.NVFP4], cuda, layers)
    # MXFP4: only layers whose shape allows it (then the native kernel takes them); NVFP4 blocks of 16
    # allow 48, the native GEMM needs 32.
    assert found == {Format.FP8: ["odd"], Format.MXFP4: [], Format.NVFP4: ["nv"]}
    with caplog.at_level("INFO", logger="lightning_snip"):
        log_setup(SNIPConfig(candidate_formats=("fp8", "mxfp4", "nvfp4")), layers, cuda, None)
    assert "1 layer(s) run fp8 emulated (weight dimensions not multiples of 16): odd (64->40)" in caplog.text
    assert "1 layer(s) run nvfp4 emulated (weight dimensions not multiples of 32): nv (48->64)" in caplog.text
    assert "every layer that can run mxfp4 has weight dimensions its native kernel takes" in caplog.text
