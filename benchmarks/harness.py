"""What the benchmarks share: models, data streams, the one-step truths, statistics and timing helpers.

Every benchmark imports this module (``from harness import ...``; a script's own folder is on its
path) and the public API of lightning_snip, nothing private and nothing from tests/ (tests import
from here where they check the same constructions).

- Models: the demo's TinyLlama (lightning_snip.demo), a random-init Hugging Face Llama
  (HFLlamaSpec) and the pretrained SmolLM2-135M (SmolLM2Spec), each with ``loss(batch)``.
- Data: ``batches`` (random windows), ``interleaved_split`` (held-out chunks from the same files),
  ``second_corpus``.
- Truths, one step, per (layer, format): ``loss_increase`` (the forward in the format, every
  other layer high: LD's truth) and ``update_deviation`` (the backward in the format: one AdamW
  update's relative deviation, WD's truth).
- Measurement: ``spearman``, ``rss_mib`` / ``reset_peak``, ``quantizer_mode``, torchao's own
  float8 / MX layers as references (``torchao_float8``, ``torchao_mx``), and ``measure_one``: a
  statistics round's time (or memory) against high-precision and emulated training steps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import statistics
import time
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr

from lightning_snip.config import SNIPConfig
from lightning_snip.statistics_round import NOISE_DRAWS, WD_PROBES
from lightning_snip.convert import convert_linears
from lightning_snip.demo.model import LlamaConfig, TinyLlama
from lightning_snip.statistics_round import estimate_divergence
from lightning_snip.formats import Format
from lightning_snip.groups import MAX_GROUP_LAYERS
from lightning_snip.probes import unbatch_probes
from lightning_snip.statistics_round import measured_formats
from lightning_snip.stats import Propagation, RoundPrecision, collect_stats, slice_batch

FORMATS = (Format.MXFP4, Format.NVFP4)


@dataclass(frozen=True)
class HFLlamaSpec:
    """A Hugging Face transformers ``LlamaForCausalLM`` (a module this project did not write: its own
    attention, RoPE, RMSNorm and grouped-query layout) with byte vocabulary, untied head."""

    dim: int = 64
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    hidden_dim: int = 192
    max_seq_len: int = 128


class HFLoss(torch.nn.Module):
    """A Hugging Face causal LM (``llama``) with the benchmark's ``loss(batch)``: next-token
    cross-entropy (the truths' functions find the decoder layers through ``llama``)."""

    def __init__(self, llama: torch.nn.Module | None = None):
        super().__init__()
        if llama is not None:
            self.llama = llama

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = self.llama(input_ids=inputs, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class HFCausalLM(HFLoss):
    """``LlamaForCausalLM`` with the benchmark's ``loss(batch)``: next-byte cross-entropy."""

    def __init__(self, spec: HFLlamaSpec):
        super().__init__()
        try:
            from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM
        except ImportError as err:  # a dev extra (pip install -e ".[dev]")
            raise SystemExit(f"--models hf needs Hugging Face transformers ({err}); pip install transformers") from err
        self.llama = LlamaForCausalLM(HFLlamaConfig(
            vocab_size=256, hidden_size=spec.dim, intermediate_size=spec.hidden_dim, num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
            max_position_embeddings=spec.max_seq_len, tie_word_embeddings=False))


@dataclass(frozen=True)
class SmolLM2Spec:
    """SmolLM2-135M-Instruct (lightning_snip.hf), pretrained: the checkpoint is the pretrained model
    after ``train_steps`` steps of continued training at ``lr`` (AdamW's moments, which WD reads, need
    a few steps), on the corpus in SmolLM2's own tokens, ``batch_size`` x ``seq_len`` per batch."""

    train_steps: int = 8
    lr: float = 1e-4
    batch_size: int = 4
    seq_len: int = 128


class SmolLM2LM(HFLoss):
    """SmolLM2's LlamaForCausalLM with the benchmark's ``loss(batch)``: next-token cross-entropy."""

    def __init__(self):
        super().__init__()
        from lightning_snip.hf import MissingPackageError, load_smollm2

        try:
            self.llama, self.tokenizer = load_smollm2()
        except MissingPackageError as err:
            raise SystemExit(f"--models smollm2: {err}") from None


def build_model(cfg: LlamaConfig | HFLlamaSpec | SmolLM2Spec) -> torch.nn.Module:
    if isinstance(cfg, SmolLM2Spec):
        return SmolLM2LM()
    return HFCausalLM(cfg) if isinstance(cfg, HFLlamaSpec) else TinyLlama(cfg)


def batches(dataset, batch_size, generator):
    while True:
        idx = torch.randint(len(dataset), (batch_size,), generator=generator)
        items = [dataset[int(i)] for i in idx]
        yield torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])


def spearman(a, b) -> float:
    return float(spearmanr(a, b).statistic)


def second_corpus() -> str:
    return str(Path(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py"))


def interleaved_split(data: torch.Tensor, fraction: float, seed: int, chunk: int = 4096):
    """(train, held-out): ``fraction`` of the corpus's 4 KiB chunks, drawn at random, held out. The
    held-out text comes from the same distribution as training (the same files, interleaved) but
    neither training nor any statistics round sees it."""
    num = len(data) // chunk
    held = torch.rand(num, generator=torch.Generator().manual_seed(seed + 99)) < fraction
    pieces = data[: num * chunk].reshape(num, chunk)
    return pieces[~held].reshape(-1), pieces[held].reshape(-1)


def block_of(fqn: str, num_blocks: int) -> int:
    """Index of the first block whose input the layer's output depends on (the head: num_blocks)."""
    return int(fqn.split(".")[1]) if fqn.startswith("layers.") else num_blocks


def forward_from(model: TinyLlama, block: int, h: torch.Tensor, targets: torch.Tensor) -> float:
    """The loss from block ``block``'s input ``h`` on (the rest of the model)."""
    T = h.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    for b in model.layers[block:]:
        h = b(h, cos, sin)
    logits = model.lm_head(model.norm(h))
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))


def precision(model: TinyLlama):
    """The context every forward pass of rounds and truths runs in: bf16 autocast after --precision
    bf16-mixed (the checkpoint itself is trained in fp32 either way: the same model as the fp32 runs)."""
    return torch.autocast("cpu", torch.bfloat16) if getattr(model, "bf16_mixed", False) else contextlib.nullcontext()


def loss_increase(model: TinyLlama, layers, batch, formats=FORMATS) -> dict:
    """(fqn, fmt) -> loss with only that layer's forward in fmt, minus the high-precision loss (the
    run's: fp32, or bf16 autocast with --precision bf16-mixed)."""
    with torch.no_grad(), precision(model):
        return loss_increase_cached(model, layers, batch, formats)


def loss_increase_cached(model: TinyLlama, layers, batch, formats) -> dict:
    if hasattr(model, "llama"):  # Hugging Face's Llama: from each decoder layer's recorded input on
        return loss_increase_hf(model, layers, batch, formats)
    if not isinstance(model, TinyLlama):  # another architecture: a whole forward pass per (layer, format)
        return loss_increase_generic(model, layers, batch, formats)
    inputs, targets = batch
    T = inputs.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    h = model.embed(inputs)
    block_inputs = [h]
    for b in model.layers:
        h = b(h, cos, sin)
        block_inputs.append(h)
    base = forward_from(model, len(model.layers), block_inputs[-1], targets)
    out = {}
    for fqn, layer in layers.items():
        start = block_of(fqn, len(model.layers))
        for fmt in formats:
            if fmt not in layer.allowed_formats:
                continue
            layer.format, layer.backward_format = fmt, Format.BF16
            out[fqn, fmt] = forward_from(model, start, block_inputs[start], targets) - base
        layer.format, layer.backward_format = Format.BF16, None
    return out


def loss_increase_hf(model, layers, batch, formats) -> dict:
    """loss_increase_generic's values for a Hugging Face decoder-only LM (``model.llama``: Llama, Gemma 3), each from
    the first decoder layer the quantized layer feeds: every decoder layer's input and keyword
    arguments (mask, rotary embeddings) are recorded on one high-precision forward and replayed."""
    inputs, targets = batch
    llama = model.llama
    blocks = llama.model.layers
    recorded = [None] * len(blocks)

    def record(index):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            recorded[index] = (hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"})
        return hook

    handles = [b.register_forward_pre_hook(record(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        out = llama.model(input_ids=inputs, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    final = out.last_hidden_state

    def loss_from(start: int) -> float:
        if start == len(blocks):
            h = final
        else:
            h = recorded[start][0]
            for i in range(start, len(blocks)):
                h = blocks[i](h, **recorded[i][1])
                h = h[0] if isinstance(h, tuple) else h
            h = llama.model.norm(h)
        logits = llama.lm_head(h)
        cap = getattr(llama.config, "final_logit_softcapping", None)  # (Gemma's, where set: as its forward does)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)))

    base = loss_from(len(blocks))
    out = {}
    for fqn, layer in layers.items():
        match = re.search(r"\blayers\.(\d+)\.", fqn)
        start = int(match.group(1)) if match else len(blocks)
        for fmt in formats:
            if fmt not in layer.allowed_formats:
                continue
            layer.format, layer.backward_format = fmt, Format.BF16
            out[fqn, fmt] = loss_from(start) - base
        layer.format, layer.backward_format = Format.BF16, None
    return out


def loss_increase_generic(model, layers, batch, formats) -> dict:
    base = float(model.loss(batch))
    out = {}
    for fqn, layer in layers.items():
        for fmt in formats:
            if fmt not in layer.allowed_formats:
                continue
            layer.format, layer.backward_format = fmt, Format.BF16
            out[fqn, fmt] = float(model.loss(batch)) - base
        layer.format, layer.backward_format = Format.BF16, None
    return out


def update_deviation(model, opt, layers, batch, sr_seeds: int, formats=FORMATS) -> dict:
    """(fqn, fmt) -> [relative one-step update deviation per stochastic-rounding seed]."""
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    # The optimizer's state restored in place before every update (a state_dict deep copy per update
    # cost SmolLM2 ~1.5 s of each ~5 s): the same values, bit for bit, as loading a saved state_dict.
    saved = {p: {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in opt.state[p].items()}
             for p in params if p in opt.state}

    def restore():
        with torch.no_grad():
            for p, b in zip(params, before):
                p.copy_(b)
        for p in params:
            if p not in saved:
                opt.state.pop(p, None)
                continue
            for k, v in saved[p].items():
                if torch.is_tensor(v):
                    opt.state[p][k].copy_(v)
                else:
                    opt.state[p][k] = copy.deepcopy(v)

    def update(seed):
        restore()
        torch.manual_seed(seed)
        loss = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [p.detach() - b for p, b in zip(model.parameters(), before)]

    ref = update(0)
    ref_norm = sum(float(r.pow(2).sum()) for r in ref)
    out = {}
    for fqn, layer in layers.items():
        for fmt in formats:
            if fmt not in layer.allowed_formats:
                continue
            layer.backward_format = fmt
            out[fqn, fmt] = []
            for seed in range(sr_seeds):
                u = update(1000 + seed)
                out[fqn, fmt].append(sum(float((a - b).pow(2).sum()) for a, b in zip(u, ref)) / ref_norm)
        layer.backward_format = None
    restore()
    return out


def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def reset_peak() -> None:
    """Reset the process's peak RSS (VmHWM) to its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


@contextlib.contextmanager
def quantizer_mode(mode: str):
    old = os.environ.get("LIGHTNING_SNIP_QUANTIZERS")
    os.environ["LIGHTNING_SNIP_QUANTIZERS"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LIGHTNING_SNIP_QUANTIZERS")
        else:
            os.environ["LIGHTNING_SNIP_QUANTIZERS"] = old


def torchao_float8(linear, recipe_name):
    """torchao's Float8Linear of ``linear`` for a named recipe, emulated (runs on a CPU)."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe_name), emulate=True)
    return Float8Linear.from_float(linear, config=config)


def torchao_mx(linear, fmt):
    """torchao's MX training GEMMs: mx_mm, the autograd function behind MXFP8Linear, with emulated
    kernels and any MX element type. Every operand is quantized along its GEMM's contraction axis
    with RCEIL scales (MXFP8Linear's default); the GEMM runs on the dequantized operands in the
    input's dtype."""
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.prototype.mx_formats.config import (
        MXFP8Dim0CastKernelChoice,
        MXFP8Dim1CastKernelChoice,
        ScaleCalculationMode,
    )
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    elem = torch.float8_e4m3fn if fmt is Format.MXFP8 else torch.float4_e2m1fn_x2

    def forward(x):
        # TORCH dim-1 casts: MXTensor.to_mx on the transposed copy (the only dim-1 path for FP4).
        y = mx_mm.apply(x, linear.weight, elem, elem, elem, 32, KernelPreference.EMULATED,
                        MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH,
                        ScaleCalculationMode.RCEIL, False)
        return y + linear.bias

    return forward


# --- the statistics round's cost in training steps (benchmarks/stats_cost.py, gpu_check.py) ---------

SEQ_LEN, BATCH = 128, 16  # 2048 rows per training step


def model_config(width: int, blocks: int) -> LlamaConfig:
    return LlamaConfig(dim=width, num_layers=blocks, num_heads=width // 32, num_kv_heads=width // 64,
                       hidden_dim=round(width * 2.75 / 32) * 32)


def peak_rise(fn) -> float:
    """MiB the peak RSS rises above the RSS before ``fn()`` while it runs."""
    before, _ = rss_mib()
    reset_peak()
    fn()
    return rss_mib()[1] - before


class RoundVariant(NamedTuple):
    """A statistics round timed beside the default one (measure_one's ``variants``)."""

    probes: int = WD_PROBES
    unbatched: bool = False  # one forward-mode pass per WD probe (the round before 2026-12-02, night)
    # None: the device's default (1 on a CPU, MAX_GROUP_LAYERS on a GPU); 1: each layer's quantizers and GEMMs
    # alone (everywhere before 2026-12-03); MAX_GROUP_LAYERS: stacked with the layers of its shape
    group_layers: int | None = None
    # the pinned LM head measured in every format too (before 2026-12-03 afternoon; measured_formats)
    pinned_measured: bool = False

    @property
    def name(self) -> str:
        """e.g. "4+unbatched+ungrouped+pinned" (benchmarks/stats_cost.py's --variants)."""
        grouping = {None: "", 1: "+ungrouped", MAX_GROUP_LAYERS: "+grouped"}.get(self.group_layers,
                                                                                f"+group{self.group_layers}")
        return f"{self.probes}{'+unbatched' if self.unbatched else ''}{grouping}{'+pinned' if self.pinned_measured else ''}"


# aten operations that launch no kernel on a GPU: views, metadata, allocations (count_kernel_ops)
_NO_KERNEL_OPS = frozenset(f"aten::{name}" for name in (
    "view _unsafe_view _reshape_alias as_strided select slice t transpose permute unsqueeze squeeze expand expand_as "
    "alias detach detach_ lift_fresh split split_with_sizes unbind chunk narrow resolve_conj resolve_neg empty "
    "empty_strided empty_like is_same_size _has_same_storage_numel result_type view_as diagonal unflatten movedim "
    "numpy_T mT set_ is_nonzero").split())
# ... and these only where they copy (a descendant copies: clone, copy_)
_COPY_IF_NEEDED_OPS = frozenset(f"aten::{name}" for name in "to reshape contiguous flatten type_as".split())


def round_formats(layers, pinned_measured: bool = False) -> dict:
    """The formats a benchmark's round measures each layer in: the callback's (statistics_round.measured_formats, a
    pinned layer in its pin only) or, ``pinned_measured``, every format its shape allows (the round before
    2026-12-03 afternoon: the pinned LM head measured in every format too)."""
    return {f: layer.allowed_formats for f, layer in layers.items()} if pinned_measured else measured_formats(layers)


def count_kernel_ops(fn) -> int:
    """A CPU proxy of the GPU kernel launches of ``fn()``: the aten operations it dispatches that are not
    inside another aten operation, less views, metadata and allocations (_NO_KERNEL_OPS) and casts or
    reshapes that copy nothing; a compiled graph's fused kernels do not appear (inductor's CPU kernels are
    no aten operations), its extern calls (a GEMM) do. Read with the profiler, which, unlike a
    TorchDispatchMode, leaves torch.compile's kernels compiled."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()

    def copies(event) -> bool:
        return any(c.name in ("aten::copy_", "aten::clone") or copies(c) for c in event.cpu_children)

    count = 0
    for event in prof.events():
        if not event.name.startswith("aten::") or event.name in _NO_KERNEL_OPS:
            continue
        if event.cpu_parent is not None and event.cpu_parent.name.startswith("aten::"):
            continue
        if event.name in _COPY_IF_NEEDED_OPS and not copies(event):
            continue
        count += 1
    return count


class _RoundBench:
    """measure_one's model, optimizer, batches and the two things it times: a training step in a format, and a
    statistics round (or a RoundVariant of it)."""

    def __init__(self, width: int, blocks: int, seed: int, device: str) -> None:
        torch.manual_seed(seed)
        self.cfg, self.seed, self.device = SNIPConfig(), seed, device
        self.model = TinyLlama(model_config(width, blocks)).to(device)
        # the LM head pinned to bf16, as SNIPCallback's default
        self.layers = convert_linears(self.model, pins=self.cfg.pin_formats)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.vocab = self.model.config.vocab_size if hasattr(self.model, "config") else 256
        tokens = torch.randint(0, 256, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(seed)).to(device)
        self.batch = (tokens[:, :-1], tokens[:, 1:])
        self.tiny = (tokens[:1, :32], tokens[:1, 1:33])

    def autocast(self):
        """On a GPU both the steps and the round run under bf16 autocast, as bf16-mixed training does."""
        return torch.autocast(self.device, torch.bfloat16) if self.device != "cpu" else contextlib.nullcontext()

    def loss_of(self, b):
        return F.cross_entropy(self.model(b[0]).reshape(-1, self.vocab), b[1].reshape(-1))

    def step(self, b, fmt: Format) -> None:
        for layer in self.layers.values():
            layer.format = fmt
        self.opt.zero_grad(set_to_none=True)
        with self.autocast():
            loss = self.loss_of(b)
        loss.backward()
        self.opt.step()
        for layer in self.layers.values():
            layer.format = Format.BF16

    def round_on(self, b, propagation: Propagation, probes: int = WD_PROBES,
                 precision: RoundPrecision = RoundPrecision.TRAINING, unbatched: bool = False,
                 group_layers: int | None = None, pinned_measured: bool = False) -> None:
        cfg = self.cfg
        sliced = slice_batch(b, cfg.max_rows)
        if unbatched:  # the probes one forward-mode pass each (the round before 2026-12-02, night)
            unbatch_probes(self.model)

        def loss_fn():
            with self.autocast():
                return self.loss_of(sliced)

        stats = collect_stats(self.model, loss_fn, layers=self.layers, optimizer=self.opt, propagation=propagation)
        try:
            estimate_divergence(stats, cfg.candidate_formats, recipe=cfg.recipe, noise_draws=NOISE_DRAWS, probes=probes,
                                precision=precision, group_layers=group_layers,
                                generator=torch.Generator(device=self.device).manual_seed(self.seed),
                                allowed=round_formats(self.layers, pinned_measured))
        finally:
            stats.release()
            if unbatched:  # (a model that fell back on its own stays unbatched)
                unbatch_probes(self.model, False)

    def variant_round(self, v: RoundVariant):
        """The round of variant ``v`` on the batch, as a callable (timed, counted, measured)."""
        return lambda: self.round_on(self.batch, Propagation.PROBE, v.probes, unbatched=v.unbatched,
                                     group_layers=v.group_layers, pinned_measured=v.pinned_measured)

    def timed(self, fn) -> float:
        if self.device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if self.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - start


def measure_one(width: int, blocks: int, repeats: int, exact: bool, seed: int, mode: str,
                variants: list[RoundVariant] = (), device: str = "cpu", fp32_round: bool = False) -> dict:
    """One configuration's measurement. ``device="cuda"`` (benchmarks/gpu_check.py) times on a GPU with
    CUDA synchronisation; memory mode is CPU-only (it reads the process's RSS); ops mode counts each
    round's operations that would launch GPU kernels (count_kernel_ops), one round each. ``fp32_round``:
    also time, interleaved, rounds whose GEMM operands are fp32 (RoundPrecision.FP32: the round before
    2026-11-30 night; the default takes them in the training dtype, bf16 under the GPU's autocast)."""
    if mode == "memory" and device != "cpu":
        raise ValueError(f"mode='memory' measures RSS and needs device='cpu', got device={device!r}")
    bench = _RoundBench(width, blocks, seed, device)
    # Adam state and every compiled quantizer kernel, on a tiny batch (no large temporaries yet).
    bench.step(bench.tiny, Format.BF16)
    bench.step(bench.tiny, Format.MXFP4)
    bench.round_on(bench.tiny, Propagation.PROBE)
    bench.opt.zero_grad(set_to_none=True)
    model = bench.model
    out = {"width": width, "blocks": blocks, "layers": len(bench.layers), "rows": BATCH * SEQ_LEN,
           "max_rows": bench.cfg.max_rows}
    out["block_param_mib"] = sum(p.numel() for p in model.layers[0].parameters()) * 4 / 2**20
    out["model_param_mib"] = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    if mode == "memory":
        return {**out, **_round_memory(bench, exact, variants)}
    if mode == "ops":
        return {**out, **_round_ops(bench, variants)}
    return {**out, **_round_times(bench, repeats, exact, variants, fp32_round)}


def _round_memory(bench: _RoundBench, exact: bool, variants) -> dict:
    out, batch = {}, bench.batch
    sliced = slice_batch(batch, bench.cfg.max_rows)
    holder = []
    out["slice_activation_mib"] = peak_rise(lambda: holder.append(bench.loss_of(sliced)))
    holder.clear()
    out["round_extra_mib"] = peak_rise(lambda: bench.round_on(batch, Propagation.PROBE))
    if exact:
        out["round_extra_mib_exact"] = peak_rise(lambda: bench.round_on(batch, Propagation.EXACT))
    out["round_extra_mib_variants"] = [[v.name, peak_rise(bench.variant_round(v))] for v in variants]
    return out


def _round_ops(bench: _RoundBench, variants) -> dict:
    def warm_count(fn) -> int:  # the second call: the first one's compilations (new shapes) dispatch ops too
        fn()
        return count_kernel_ops(fn)

    return {"ops_hp_step": warm_count(lambda: bench.step(bench.batch, Format.BF16)),
            "ops_round": warm_count(lambda: bench.round_on(bench.batch, Propagation.PROBE)),
            "ops_variants": [[v.name, warm_count(bench.variant_round(v))] for v in variants]}


def _round_times(bench: _RoundBench, repeats: int, exact: bool, variants, fp32_round: bool) -> dict:
    batch, timed, out = bench.batch, bench.timed, {}
    hp, emulated, probe, exact_times, fp32_times = [], [], [], [], []
    variant_times = {v: [] for v in variants}
    for _ in range(repeats):  # interleaved: the machine is shared
        hp.append(timed(lambda: bench.step(batch, Format.BF16)))
        emulated.append(timed(lambda: bench.step(batch, Format.MXFP4)))
        probe.append(timed(lambda: bench.round_on(batch, Propagation.PROBE)))
        if fp32_round:
            fp32_times.append(timed(lambda: bench.round_on(batch, Propagation.PROBE, precision=RoundPrecision.FP32)))
        for v, times in variant_times.items():
            times.append(timed(bench.variant_round(v)))
        if exact:
            exact_times.append(timed(lambda: bench.round_on(batch, Propagation.EXACT)))
    out["hp_step_seconds"] = statistics.median(hp)
    out["emulated_step_seconds"] = statistics.median(emulated)
    out["round_seconds"] = statistics.median(probe)
    out["variants"] = [[v.name, statistics.median(t)] for v, t in variant_times.items()]
    if exact:
        out["round_seconds_exact"] = statistics.median(exact_times)
    if fp32_round:
        out["round_seconds_fp32"] = statistics.median(fp32_times)
    if bench.device != "cpu":  # peak GPU memory over what was allocated before: the round's (and its variants') extra
        def peak_extra_mib(fn) -> float:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - before) / 2**20

        out["hp_step_peak_extra_mib"] = peak_extra_mib(lambda: bench.step(batch, Format.BF16))
        out["round_peak_extra_mib"] = peak_extra_mib(lambda: bench.round_on(batch, Propagation.PROBE))
        out["variants_peak_extra_mib"] = [[v.name, peak_extra_mib(bench.variant_round(v))] for v in variants]
    return out

def broken_fp4_forward(layers, fmt: Format, *, mode: str = "nan"):
    """A replacement for lightning_snip.linear's ``quantized_matmul`` (for monkeypatch.setattr) whose forward
    GEMM of ``layers`` (SNIPLinear modules) in ``fmt`` is broken on purpose: ``mode`` "nan" writes NaN (a
    quantizer that divides by a zero scale), "noise" adds noise 10x the output's size (one that scrambles its
    blocks). Other layers, formats and the gradient GEMMs are left alone."""
    import lightning_snip.linear as linear

    real = linear.quantized_matmul
    weights = [layer.weight for layer in layers]

    def quantized_matmul(a, b, f, *args, **kw):
        out = real(a, b, f, *args, **kw)
        if f is fmt and not kw.get("a_is_grad") and any(b is w for w in weights):
            if mode == "nan":
                return out * float("nan")
            return out + 10 * out.detach().std() * torch.randn_like(out)
        return out

    return quantized_matmul


TRAINING_PATH_FAULTS = ("negated_fp4_gradients", "zeroed_fp4_gradients", "noisy_fp4_forward", "broken_fp8_forward")


def training_path_fault(kind: str):
    """A replacement for lightning_snip.linear's ``quantized_matmul`` (the training path's GEMMs only: the
    statistics round calls gemm.quantized_matmul itself) with one of TRAINING_PATH_FAULTS, in every layer:
    "negated_fp4_gradients" / "zeroed_fp4_gradients": the dgrad and wgrad GEMMs in an FP4 format return the
    negated / zero product; "noisy_fp4_forward": an FP4 forward GEMM adds Gaussian noise 1x its output's standard
    deviation; "broken_fp8_forward": an FP8 forward GEMM returns every other 16-column block of its output as
    zeros (an all-zero block, as a GPU kernel once gave)."""
    import lightning_snip.linear as linear

    if kind not in TRAINING_PATH_FAULTS:
        raise ValueError(f"kind: invalid value {kind!r}; allowed: {', '.join(TRAINING_PATH_FAULTS)}")
    real = linear.quantized_matmul

    def quantized_matmul(a, b, f, *args, **kw):
        out = real(a, b, f, *args, **kw)
        grad = kw.get("a_is_grad", False)
        if kind == "negated_fp4_gradients" and grad and f.is_fp4:
            return -out
        if kind == "zeroed_fp4_gradients" and grad and f.is_fp4:
            return torch.zeros_like(out)
        if kind == "noisy_fp4_forward" and not grad and f.is_fp4:
            return out + out.detach().float().std().to(out.dtype) * torch.randn_like(out)
        if kind == "broken_fp8_forward" and not grad and f is Format.FP8:
            mask = (torch.arange(out.shape[-1], device=out.device) // 16) % 2 == 0
            return out * mask.to(out.dtype)
        return out

    return quantized_matmul


def bench_dir(name: str, default: str = "snip_compare_v2") -> Path:
    """A benchmark's scratch folder (pretrained checkpoints, per-run folders), created: $SNIP_BENCH_DIR/<name>, or the
    temporary directory's ``default``/<name>. Never committed; a checkpoint there is rebuilt when missing."""
    import tempfile  # (only here: the rest of this module needs no temporary files)
    work = Path(os.environ.get("SNIP_BENCH_DIR", os.path.join(tempfile.gettempdir(), default))) / name
    work.mkdir(parents=True, exist_ok=True)
    return work


def machine_line(script: str, workers: int) -> str:
    """The results header's command and machine, for a benchmark whose runs take 1 thread each, ``workers`` at a
    time: what to type to reproduce it and where it ran."""
    import platform
    import sys
    return (f"command: `python benchmarks/{script} {' '.join(sys.argv[1:])}`; machine: {platform.machine()} "
            f"({os.cpu_count()} cores), Python {platform.python_version()}; FP4 emulated; runs 1 thread each, "
            f"{workers} at a time")


def cached_json(path: Path, run):
    """``run()``'s result, cached as JSON at ``path``: a benchmark rerun resumes from the runs that finished."""
    import json

    if path.exists():
        return json.loads(path.read_text())
    result = run()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def mean_std(values) -> tuple[float, float]:
    """(mean, sample standard deviation; NaN for one value)."""
    values = list(values)
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan")


def warm_up_config(config: SNIPConfig) -> SNIPConfig:
    """``config`` for a short warm-up run before an A/B in one process (8 steps: a round at step 4, its plan at 5).
    lightning_snip's quantizer kernels compile on first use, once per process (lightning_snip.kernels): without a
    warm-up the pair's first run pays every format's compile and the second reuses them."""
    return dataclasses.replace(config, warmup_steps=4, interval=max(config.interval, 8), first_order_steps=2)
