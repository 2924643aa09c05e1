"""Quality benchmark v2 (issue 15): SNIP against an oracle and the baselines at equal FP4 FLOPs fraction.

Pretrains a demo model in high precision (one checkpoint per setting), measures at that checkpoint the
truths the oracle plans from, then continues the same number of steps from it under each policy and
reports the held-out eval loss gap to the all-bf16 continuation (evaluated in high precision), mean
and std over seeds. A seed sets the continuation's data order, stochastic rounding and the random
policy; the pretraining and the truths are shared by all seeds.

Policies at each FP4 fraction (candidates fp8 / mxfp4 / nvfp4; the fixed rules use the setting's
``low`` FP4 format and fp8; the LM head pinned bf16 everywhere):
  snip, snip_gemm        the callback (granularity layer / gemm), plans from its own statistics rounds
                         (fp4_fraction of the whole model's linear FLOPs: target_scope=model; +rows<n>:
                         max_rows=n, the statistics slice; run only where --policies names it)
  oracle, oracle_gemm    the same ILP fed with measured truths instead of estimates: per layer and
                         format, the mean relative loss increase over K batches with only its forward
                         in the format (LD's truth) and the one-step AdamW update deviation with only
                         its backward in the format (WD's truth, mean over SR seeds), at the checkpoint
  oracle_pooled(_gemm)   the same with each truth replaced by its class's mean (layer type x first / inner /
                         last block x format): the single truths' noise removed
  random, random_gemm    FP4 layers (GEMM directions) in a random order
  min_rel_err            smallest relative local quantization error first (measured at the checkpoint)
  layer_type             MLP first, attention last ("FP4 MLP, FP8 attention")
  layer_type_gemm        its per-GEMM version: every backward GEMM (MLP first) before any forward GEMM
  layer_type_edges_gemm  the same with first_last's rule added: the first and last blocks' forwards after
                         every other block's, within a type the middle blocks first
  first_last             first and last blocks high, FP4 from the middle out
  industry_tail          the industry's rule: first two and last ~15% of blocks high (NVIDIA's NVFP4
                         recipe; torchtitan's tail rule), extended past its natural fraction
  industry_tail_gemm     its per-GEMM version: every backward GEMM first (in the rule's order), then the
                         forwards by the rule (quality v4, benchmarks/quality_long.py)
and at their own fractions: all_bf16, all_fp8 ("0.0"), all_fp4 ("1.0"), backward_only (every
backward in FP4, forward fp8: its natural fraction), and where --policies names it nvfp4_recipe (the published
NVFP4 training recipe: NVFP4 with the recipe's numerics in every linear layer but its BF16 blocks, the first and
last blocks by the paper's shares of the depth; lightning_snip.baselines.nvfp4_recipe_plan).

    python benchmarks/compare_policies.py [--setting deep8] [--seeds 5] [--fractions 0.75 0.9]
    python benchmarks/compare_policies.py --search deep8 deep8_lr ...   # the setting search
    python benchmarks/compare_policies.py --quick                       # smoke run, a few minutes

Writes benchmarks/results/compare_policies_v2.json, compare_policies_v2_<date>.md, compare_policies_v2.png
and compare_policies_v2_runs.json (search: compare_policies_v2_search_<date>.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import datetime
import functools
import json
import logging
import math
import multiprocessing
import os
import tempfile
import platform
import re
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CANDIDATES = ("fp8", "mxfp4", "nvfp4")
PINS = {"*lm_head": "bf16"}
FRACTION_POLICIES = ("snip", "snip_gemm", "oracle", "oracle_gemm", "oracle_pooled", "oracle_pooled_gemm", "random",
                     "random_gemm", "min_rel_err",
                     "layer_type", "layer_type_gemm", "layer_type_edges_gemm", "first_last", "industry_tail")
BASELINES = ("random", "random_gemm", "min_rel_err", "layer_type", "layer_type_gemm", "layer_type_edges_gemm",
             "first_last", "industry_tail", "industry_tail_gemm", "backward_only", "nvfp4_recipe")
# Policies at their own FP4 fraction (the row's fraction is what its plan reached): every backward GEMM in FP4, and
# the published NVFP4 training recipe (issue 63: NVFP4 with the recipe but its BF16 blocks; nvfp4 is added to the
# setting's candidates for it)
NATURAL = ("backward_only", "nvfp4_recipe")
PER_LAYER = ("random", "min_rel_err", "layer_type", "first_last", "industry_tail")
FIXED_RULES = ("layer_type", "layer_type_gemm", "layer_type_edges_gemm", "first_last", "industry_tail",
               "industry_tail_gemm")
SEARCH_POLICIES = ("oracle", "oracle_gemm", "min_rel_err") + FIXED_RULES


@dataclass(frozen=True)
class Setup:
    dim: int = 0  # the demo model's shape (model "demo"); SmolLM2's is its checkpoint's
    num_layers: int = 0
    hidden_dim: int = 0
    seq_len: int = 128
    batch_size: int = 16
    lr: float = 3e-3
    pretrain_steps: int = 300  # smollm2: the shared high-precision steps before the checkpoint (lr warmup)
    continue_steps: int = 60
    snip_interval: int = 20
    low: str = "nvfp4"  # the fixed rules' FP4 format (and all_fp4's)
    truth_batches: int = 32  # K: batches of LD's truth
    truth_sr_seeds: int = 2  # stochastic-rounding seeds of WD's truth
    model: str = "demo"  # demo (trained from scratch here) | smollm2 (SmolLM2-135M-Instruct, continued)
    candidates: tuple[str, ...] = CANDIDATES
    eval_batches: int = 10**6  # held-out batches evaluated (the demo: the whole held-out tail)
    max_rows: int = 1024  # SNIP's statistics round (SNIPConfig's defaults unless the setting says)
    first_order_steps: int = 32
    first_order_rows: int = 1024  # (the sample's rows are SNIPConfig.max_rows since 2026-12-04: every setting had both equal)
    accelerator: str = "cpu"  # the Trainer's (smollm2_gpu: "gpu", one device)
    precision: str = "32-true"
    trajectory_every: int = 0  # > 0: also the held-out loss (high precision) every this many continuation steps
    # Quality v5 (issue 65): continuation steps before any FP4 policy's plan: SNIP's warmup_steps under +ships (its
    # first-order sample and first round then, its plan one step later, as in a user's resumed run), and the step the
    # fixed FP4 plans apply at (the same one; until then every layer in SNIP's initial format, fp8); 0: every plan from
    # the checkpoint (quality v2-v4). all_bf16 / all_fp8 apply theirs from the checkpoint either way.
    plan_start: int = 0
    # "model": FP4 fractions are shares of the whole model's linear FLOPs (v2-v4); "switchable": of the unpinned layers'
    # (SNIPConfig's default target_scope), for the fixed plans too (converted with lightning_snip.evidence.model_target)
    target_scope: str = "model"

    def __post_init__(self):
        object.__setattr__(self, "candidates", tuple(self.candidates))  # from a JSON list


SETTINGS = {
    # v1's setting (benchmarks/results/compare_policies_2026-11-29.md), 4 blocks.
    "demo4": Setup(dim=128, num_layers=4, hidden_dim=352, seq_len=128, batch_size=16, lr=3e-3,
                   pretrain_steps=300, continue_steps=120, snip_interval=40),
    # The full benchmark's setting. truth_batches 96: at 32 (the search) the LD truth's split-half
    # agreement was 0.78-0.88 and the oracle's plan summed to a negative total LD: it chose the layers
    # whose truth came out negative by noise (the optimizer's curse).
    "deep8": Setup(dim=64, num_layers=8, hidden_dim=192, seq_len=128, batch_size=16, lr=3e-3,
                   pretrain_steps=300, continue_steps=60, snip_interval=20, truth_batches=96),
    "deep8_lr": Setup(dim=64, num_layers=8, hidden_dim=192, seq_len=128, batch_size=16, lr=6e-3,
                      pretrain_steps=300, continue_steps=60, snip_interval=20),
    "deep8_mx": Setup(dim=64, num_layers=8, hidden_dim=192, seq_len=128, batch_size=16, lr=3e-3,
                      pretrain_steps=300, continue_steps=60, snip_interval=20, low="mxfp4"),
    # MLP share of a block's linear FLOPs 2/3 (deep8: 3/4, which makes "MLP in FP4" exactly the 0.75 plan).
    "deep8_h128": Setup(dim=64, num_layers=8, hidden_dim=128, seq_len=128, batch_size=16, lr=3e-3,
                        pretrain_steps=300, continue_steps=60, snip_interval=20),
    # Four times the pretraining and twice the continuation: features (and outliers) that a longer-trained
    # model develops might make the layers differ more in their FP4 damage.
    "deep8_long": Setup(dim=64, num_layers=8, hidden_dim=192, seq_len=128, batch_size=16, lr=3e-3,
                        pretrain_steps=1200, continue_steps=120, snip_interval=40, truth_batches=64),
    "deep12": Setup(dim=64, num_layers=12, hidden_dim=192, seq_len=128, batch_size=16, lr=3e-3,
                    pretrain_steps=300, continue_steps=60, snip_interval=20),
    "quick": Setup(dim=64, num_layers=3, hidden_dim=192, seq_len=64, batch_size=8, lr=3e-3,
                   pretrain_steps=30, continue_steps=8, snip_interval=4, truth_batches=4),
    # Issue 32: continued pretraining of SmolLM2-135M-Instruct (211 linears, massive activations in a few
    # down_projs), sized by benchmarks/results/smollm2_speed_2026-12-01.md (a high-precision step of
    # 4 x 128 tokens 3.7 s on 2 threads, a plan's ~1.6x, a round of 256 rows ~12 steps): 4 shared
    # high-precision steps (the lr warmup; AdamW's moments for WD and the truths), then 16 steps under
    # each policy, cosine to 0.1 x lr; SNIP's rounds at the checkpoint and 8 steps later, each plan
    # applied one step after; the candidates and the rules' FP4 format those of the app's preset
    # (fp8, mxfp4); the held-out loss over 16 batches (8192 tokens) of the corpus's tail.
    "smollm2": Setup(model="smollm2", seq_len=128, batch_size=4, lr=3e-4, pretrain_steps=4, continue_steps=16,
                     snip_interval=8, low="mxfp4", candidates=("fp8", "mxfp4"), truth_batches=4, truth_sr_seeds=1,
                     eval_batches=16, max_rows=256, first_order_steps=4, first_order_rows=256),
    # The GPU protocol (issue 32): the same benchmark at 10x the tokens (4 x 128 -> 8 x 256 per step, 2.5x
    # the steps: 81920 tokens per run), bf16-mixed on one GPU, the truths and the round at the batch's
    # rows; one worker (the GPU), every run cached under --store as it ends (a cut-off run keeps them).
    "smollm2_gpu": Setup(model="smollm2", seq_len=256, batch_size=8, lr=3e-4, pretrain_steps=10, continue_steps=40,
                         snip_interval=20, low="mxfp4", candidates=("fp8", "mxfp4"), truth_batches=4, truth_sr_seeds=2,
                         eval_batches=10**6, max_rows=2048, first_order_steps=4, first_order_rows=2048,
                         accelerator="gpu", precision="bf16-mixed"),
    # Issue 52 (quality v4, benchmarks/quality_long.py): the smollm2 protocol over 4x the horizon (64 steps of
    # 4 x 128 tokens after the same checkpoint, so the same truths), the held-out loss every 16 steps.
    "smollm2_long": Setup(model="smollm2", seq_len=128, batch_size=4, lr=3e-4, pretrain_steps=4, continue_steps=64,
                          snip_interval=8, low="mxfp4", candidates=("fp8", "mxfp4"), truth_batches=4, truth_sr_seeds=1,
                          eval_batches=16, max_rows=256, first_order_steps=4, first_order_rows=256, trajectory_every=16),
    # Issue 64 (a second pretrained family): Gemma 3 270M continued as smollm2_long continues SmolLM2 (its own 4-step
    # checkpoint and truths; the FP4 candidate the library's default, nvfp4).
    "gemma3": Setup(model="gemma3", seq_len=128, batch_size=4, lr=3e-4, pretrain_steps=4, continue_steps=64,
                    snip_interval=8, low="nvfp4", candidates=("fp8", "nvfp4"), truth_batches=4, truth_sr_seeds=2,
                    eval_batches=16, max_rows=256, first_order_steps=4, first_order_rows=256),
    # Issue 65 (quality v5, benchmarks/quality_v5.py): smollm2_long's checkpoint and horizon with SNIP as it ships
    # (SNIPConfig's candidates fp8 / nvfp4, max_rows 1024 and first_order_steps 32, the target on the switchable
    # layers) but for a 16-step warm-up, the fixed FP4 plans applied at SNIP's first plan's step; snip_interval unused.
    "smollm2_v5": Setup(model="smollm2", seq_len=128, batch_size=4, lr=3e-4, pretrain_steps=4, continue_steps=64,
                        snip_interval=100, low="nvfp4", candidates=("fp8", "nvfp4"), truth_batches=4, truth_sr_seeds=1,
                        eval_batches=16, max_rows=1024, first_order_steps=32, first_order_rows=1024,
                        trajectory_every=16, plan_start=16, target_scope="switchable"),
    # Issue 65, Deliver 4: quality v5's protocol on Gemma 3 270M (the gemma3 setting's checkpoint and truths' SR seeds).
    "gemma3_v5": Setup(model="gemma3", seq_len=128, batch_size=4, lr=3e-4, pretrain_steps=4, continue_steps=64,
                       snip_interval=100, low="nvfp4", candidates=("fp8", "nvfp4"), truth_batches=4, truth_sr_seeds=2,
                       eval_batches=16, max_rows=1024, first_order_steps=32, first_order_rows=1024,
                       trajectory_every=16, plan_start=16, target_scope="switchable"),
    "smollm2_quick": Setup(model="smollm2", seq_len=32, batch_size=2, lr=3e-4, pretrain_steps=2, continue_steps=3,
                           snip_interval=2, low="mxfp4", candidates=("fp8", "mxfp4"), truth_batches=2,
                           truth_sr_seeds=1, eval_batches=2, max_rows=64, first_order_steps=1, first_order_rows=64),
}


def model_config(s: Setup):
    from lightning_snip.demo.model import LlamaConfig

    return LlamaConfig(dim=s.dim, num_layers=s.num_layers, num_heads=4, num_kv_heads=2, hidden_dim=s.hidden_dim)


PRETRAINED = ("smollm2", "gemma3")  # the packaged pretrained models a setting can continue (lightning_snip.hf)


@functools.lru_cache(maxsize=1)
def _pretrained(name: str):
    """(model, tokenizer) of a packaged pretrained model, loaded once per process (SmolLM2 ~25 s, Gemma 3 ~80 s);
    every run deep-copies the model."""
    from lightning_snip.hf import load_packaged

    return load_packaged(name, progress=False)


def run_module(s: Setup, *, continuation: bool = False):
    """The LightningModule of a run: the demo's DemoLM (the continuation decays its learning rate
    linearly to 0: its final iterate depends far less on the data order, which lowers the seed-to-seed
    noise floor of the comparison), or SmolLM2 in CausalLM (linear warmup over the shared
    pretrain_steps, then cosine decay to 0.1 x lr at the continuation's end: a real continuation's
    schedule, the checkpoint at the warmup's end)."""
    import copy

    from lightning_snip.demo.lightning import CausalLM, DemoLM

    if s.model in PRETRAINED:
        return CausalLM(copy.deepcopy(_pretrained(s.model)[0]), lr=s.lr, warmup_steps=s.pretrain_steps, cosine=True,
                        min_lr_ratio=0.1)
    if continuation:
        return DemoLM(model_config(s), lr=s.lr, lr_decay_start=s.pretrain_steps, lr_decay_steps=s.continue_steps)
    return DemoLM(model_config(s), lr=s.lr)


def data_module(s: Setup, seed: int):
    """The setting's data module with seed ``seed`` (its stream's order; the pretrained models tokenize with their own)."""
    from lightning_snip.demo.lightning import ByteTextDataModule

    # val_batches large enough to cover the whole held-out tail: a low-noise eval.
    tokenizer = _pretrained(s.model)[1] if s.model in PRETRAINED else None
    return ByteTextDataModule(seq_len=s.seq_len, batch_size=s.batch_size, val_batches=s.eval_batches, seed=seed,
                              tokenizer=tokenizer)


def _trainer(s: Setup, max_steps: int, callbacks, root: Path):
    import lightning.pytorch as pl

    return pl.Trainer(max_steps=max_steps, accelerator=s.accelerator, devices=1, precision=s.precision,
                      callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, default_root_dir=root)


def pretrain(s: Setup, root: Path, *, with_truths: bool = True) -> tuple[Path, dict]:
    """High-precision pretraining -> checkpoint, and what the checkpoint-dependent policies plan from:
    each layer's relative local error in the low format (min_rel_err) and (``with_truths``) the
    oracle's truths (measure_truths). ``fingerprint`` tells whether a regenerated checkpoint is the
    one the cached runs continued from."""
    import lightning.pytorch as pl
    import torch

    from lightning_snip.statistics_round import estimate_divergence
    from lightning_snip.formats import Format
    from lightning_snip.stats import collect_stats, slice_batch

    torch.set_num_threads(2)
    pl.seed_everything(1234)
    module = run_module(s)
    data = data_module(s, seed=1234)
    trainer = _trainer(s, s.pretrain_steps, [], root)
    trainer.fit(module, datamodule=data)
    ckpt = root / "pretrained.ckpt"
    trainer.save_checkpoint(ckpt)

    model, layers = truth_model(s, module)
    low = Format.parse(s.low)
    device = next(module.parameters()).device
    batch = [t.to(device) for t in slice_batch(next(iter(data.train_dataloader())), 1024)]
    stats = collect_stats(model, lambda: model.loss(batch), layers=layers)
    rel_error = {f"model.{fqn}": d.rel_error_forward[low] for fqn, d in estimate_divergence(stats, [low], noise_draws=0).layers.items()}
    stats.release()
    measured = {"rel_error": rel_error, "fingerprint": fingerprint(module), "checkpoint_eval_loss": held_out_loss(module, data),
                "pretrain_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))), "versions": versions()}
    if with_truths:
        measured.update(measure_truths(s, model, trainer.optimizers[0], layers, data))
    return ckpt, measured


def held_out_loss(module, data) -> float:
    """The mean next-token loss over the held-out batches (the corpus's tail), in the layers' formats."""
    import torch

    losses = []
    device = next(module.parameters()).device
    with torch.no_grad():
        for batch in data.val_dataloader():
            batch = [t.to(device) for t in batch]
            losses.append((module.snip_loss(batch).item(), len(batch[0])))
    return sum(l * n for l, n in losses) / sum(n for _, n in losses)


def fingerprint(module) -> str:
    """The checkpoint's weights in one number (the sum of |w| in float64, to 12 digits)."""
    import torch

    with torch.no_grad():
        return f"{sum(float(p.double().abs().sum()) for p in module.parameters()):.12e}"


def versions() -> str:
    """The packages a checkpoint's numbers depend on. Gemma 3's 4 pretraining steps regenerated on 2026-12-07 ended
    6.6e-8 (relative) from 2026-12-06's (held-out loss 3.62148 against 3.62183) with the same code, while two
    regenerations in one session agree to the last digit: recorded since, so that the next such change has a cause."""
    from importlib import metadata

    found = []
    for name in ("torch", "transformers", "gguf", "lightning"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def same_checkpoint(mine: str, theirs: str) -> bool:
    """Whether two fingerprints name the same pretraining. Measured 2026-12-02: SmolLM2's 4 pretraining
    steps regenerated on this machine type end 1e-11 (relative) from an earlier session's (1.861693311702e+07
    vs ...684e+07: the order of float reductions differs between runs); a difference above 1e-9 is
    another checkpoint."""
    a, b = float(mine), float(theirs)
    return abs(a - b) <= 1e-9 * abs(b)


def truth_model(s: Setup, module):
    """(the model with ``loss(batch)`` the truths and rel_error measure, its switchable linears but the
    LM head): the demo's TinyLlama, or SmolLM2 wrapped in harness.HFLoss."""
    from harness import HFLoss
    from lightning_snip.convert import convert_linears

    model = HFLoss(module.model) if s.model in PRETRAINED else module.model
    layers = {fqn: layer for fqn, layer in convert_linears(module.model).items() if not fqn.endswith("lm_head")}
    return model, layers


def from_checkpoint(s: Setup, ckpt: Path):
    """(module, AdamW with the checkpoint's moments, data set up) as the pretraining left them."""
    import torch

    torch.set_num_threads(2)
    module = run_module(s)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    module.load_state_dict(state["state_dict"])
    module.to("cuda" if s.accelerator == "gpu" else "cpu")
    optimizer = torch.optim.AdamW(module.parameters(), lr=s.lr, weight_decay=module.weight_decay, betas=(0.9, 0.95))
    optimizer.load_state_dict(state["optimizer_states"][0])
    data = data_module(s, seed=1234)
    data.setup()
    return module, optimizer, data


def measure_truths(s: Setup, model, optimizer, layers, data, parts: Path | None = None, chunk: int | None = None) -> dict:
    """The oracle's truths at the checkpoint, on training-distribution batches drawn apart from the
    continuation's stream (their own generator; the eval data, the corpus's tail, is never used): per
    layer and candidate format, LD's truth (the mean relative loss increase over ``truth_batches``
    batches with only its forward in the format) and WD's (the one-step AdamW update deviation with
    only its backward in it, mean over ``truth_sr_seeds`` SR seeds), with their split-half ceilings.
    ``parts``: a JSON file each finished batch (LD) and each ``chunk`` of layers (WD) is saved to as it
    ends, and read back instead of measured again (SmolLM2's truths take tens of minutes)."""
    import torch

    from harness import batches, loss_increase, spearman, update_deviation
    from lightning_snip.demo.data import ByteWindows
    from lightning_snip.formats import Format

    start = time.perf_counter()
    formats = [Format.parse(f) for f in s.candidates]
    stream = batches(ByteWindows(data.train_set.data, s.seq_len), s.batch_size, torch.Generator().manual_seed(777))
    device = next(model.parameters()).device
    per = [tuple(t.to(device) for t in next(stream)) for _ in range(s.truth_batches)]
    wd_batch = tuple(t.to(device) for t in next(stream))
    saved = json.loads(parts.read_text()) if parts is not None and parts.exists() else {}

    def cached(key: str, measure):
        if key not in saved:
            saved[key] = [[fqn, fmt.value, v] for (fqn, fmt), v in measure().items()]
            if parts is not None:
                parts.write_text(json.dumps(saved))
        return {(fqn, Format.parse(fmt)): v for fqn, fmt, v in saved[key]}

    with torch.no_grad():
        base = [float(model.loss(b)) for b in per]
    per_batch = [cached(f"ld{i}", lambda b=b: loss_increase(model, layers, b, formats)) for i, b in enumerate(per)]
    names = list(layers)
    size = chunk or len(names)
    devs = {}
    for i in range(0, len(names), size):
        part = {n: layers[n] for n in names[i:i + size]}
        devs.update(cached(f"wd{i}", lambda part=part: {
            k: v for k, v in update_deviation(model, optimizer, part, wd_batch, s.truth_sr_seeds, formats).items()}))
    seconds = time.perf_counter() - start
    mean_loss = sum(base) / len(base)
    keys = sorted(per_batch[0], key=lambda k: (k[0], k[1].value))
    half = len(per_batch) // 2

    def mean_ld(part):
        return {k: sum(b[k] for b in part) / len(part) / mean_loss for k in keys}

    ld_truth, wd_truth = mean_ld(per_batch), {k: sum(v) / len(v) for k, v in devs.items()}
    ceilings = {}
    for fmt in formats:
        ks = [k for k in keys if k[1] is fmt]
        a, b = mean_ld(per_batch[:half]), mean_ld(per_batch[half:])
        ceilings[f"loss_{fmt.value}"] = spearman([a[k] for k in ks], [b[k] for k in ks])
        n = s.truth_sr_seeds // 2
        ceilings[f"weights_{fmt.value}"] = spearman([sum(devs[k][:n]) for k in ks], [sum(devs[k][n:]) for k in ks]) if n else float("nan")
    truths = {
        "loss_divergence": {f"model.{fqn}|{fmt.value}": v for (fqn, fmt), v in ld_truth.items()},
        "weight_divergence": {f"model.{fqn}|{fmt.value}": v for (fqn, fmt), v in wd_truth.items()},
    }
    return {"truths": truths, "ceilings": ceilings, "truth_seconds": seconds}


def plan_candidates(module, measured: dict | None, candidates=CANDIDATES):
    """The planner's LayerCandidates for the continuation's model, as SNIP's own are built
    (evidence.layer_candidates: the shape's formats, its FLOPs, the clamp at 0): the oracle's truths
    where given, else zeros and bf16 as a candidate (the fixed rules need only the FLOPs, candidates and
    pins; all_bf16 needs bf16). A pinned layer's values are 0: its pin is not the planner's choice."""
    import dataclasses

    from lightning_snip.convert import convert_linears
    from lightning_snip.evidence import layer_candidates
    from lightning_snip.formats import Format

    layers = convert_linears(module, pins=PINS)  # converted again by the callback: a no-op
    formats = [Format.parse(f) for f in candidates]
    if measured is None:
        return layer_candidates(layers, [*formats, Format.BF16])
    nested = {metric: {} for metric in ("loss_divergence", "weight_divergence")}
    for metric, values in measured.items():
        for key, value in values.items():
            fqn, _, fmt = key.partition("|")
            nested[metric].setdefault(fqn, {})[Format(fmt)] = value
    out = layer_candidates(layers, formats, **nested)
    return [dataclasses.replace(c, loss_divergence={f: 0.0 for f in c.loss_divergence},
                                weight_divergence={f: 0.0 for f in c.weight_divergence})
            if c.pinned is not None else c for c in out]


def oracle_lambda(policy: str) -> float:
    """The oracle is SNIP's ILP fed with truths: by default at SNIP's lambda (0.1), as SNIP's runs are;
    "oracle@1" / "oracle_gemm@1" at another (the 2026-11-30 runs were made at 1, before SNIP's default
    became 0.1)."""
    from lightning_snip.planner import DEFAULT_WEIGHT_DIVERGENCE_WEIGHT

    _, _, lam = policy.partition("@")
    return float(lam) if lam else DEFAULT_WEIGHT_DIVERGENCE_WEIGHT


_BLOCK = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")  # an fqn's first integer component: its block ("layers.3.")


def layer_classes(fqns) -> dict[str, str]:
    """fqn -> its class: the same module in the other blocks of its stack, split into the stack's first
    block, its inner blocks and its last block (a stack: the name before the first integer component, its
    block range the one ``fqns`` span; the module: the name after it). A layer with no integer component
    (an LM head) is a class of its own."""
    parsed = {}
    for fqn in fqns:
        match = _BLOCK.search(fqn)
        parsed[fqn] = None if match is None else (fqn[:match.start(1)], int(match.group(1)), fqn[match.end(1):])
    ranges: dict[str, tuple[int, int]] = {}
    for stack, block, _ in filter(None, parsed.values()):
        lo, hi = ranges.get(stack, (block, block))
        ranges[stack] = (min(lo, block), max(hi, block))
    out = {}
    for fqn, p in parsed.items():
        if p is None:
            out[fqn] = fqn
            continue
        stack, block, module = p
        lo, hi = ranges[stack]
        out[fqn] = f"{stack}*{module}@{'first' if block == lo else 'last' if block == hi else 'inner'}"
    return out


def pooled_truths(truths: dict) -> dict:
    """The truths averaged over each class of layers: (layer type, first / inner / last block, format),
    for LD and WD apart (layer_classes). A single layer's truth is noisy (at deep8 16 of 56 layers' LD
    truth per FP4 format comes out <= 0, which the clamp makes free for the ILP); a class mean much less
    so. The oracle_pooled policies plan from these: do they beat the oracle, i.e. was its loss the
    noise? Non-finite truths and classes of one finite member are kept as they are."""
    out = {}
    for metric, values in truths.items():
        classes = layer_classes(dict.fromkeys(key.partition("|")[0] for key in values))
        members: dict[tuple[str, str], list[str]] = {}
        for key, value in values.items():
            fqn, _, fmt = key.partition("|")
            if math.isfinite(value):
                members.setdefault((classes[fqn], fmt), []).append(key)
        out[metric] = dict(values)
        for keys in members.values():
            if len(keys) > 1:
                out[metric].update(dict.fromkeys(keys, math.fsum(values[k] for k in keys) / len(keys)))
    return out


def fixed_plan(policy: str, fraction: float, seed: int, module, s: Setup, measured: dict):
    """The plan of a fixed policy: the oracle (SNIP's ILP on the truths) or a baseline of the registry."""
    from lightning_snip import planner
    from lightning_snip.baselines import PolicyContext, baseline_plan
    from lightning_snip.formats import Format

    base = policy.partition("@")[0]
    fraction = model_fraction(s, module, fraction) if fraction else fraction
    if base.startswith("oracle"):
        truths = pooled_truths(measured["truths"]) if base.startswith("oracle_pooled") else measured["truths"]
        solve = planner.solve_gemm_plan if base.endswith("_gemm") else planner.solve_plan
        return solve(plan_candidates(module, truths, s.candidates), fp4_fraction=fraction,
                     weight_divergence_weight=oracle_lambda(policy))
    context = PolicyContext(fp4_fraction=fraction, seed=seed, low=Format.parse(s.low), high=Format.FP8,
                            relative_error=measured.get("rel_error"))
    return baseline_plan(policy, plan_candidates(module, None, policy_formats(s, policy)), context)


def model_fraction(s: Setup, module, fraction: float) -> float:
    """A setting's FP4 fraction as a share of the whole model's linear FLOPs, what the fixed plans and the oracle's
    ILP constrain: itself under target_scope "model", else (a share of the switchable layers) converted as SNIP
    converts its own target (lightning_snip.evidence.model_target: the same plan as the switchable target)."""
    from lightning_snip.config import SNIPConfig
    from lightning_snip.evidence import model_target

    if s.target_scope == "model":
        return fraction
    return model_target(plan_candidates(module, None, s.candidates),
                        SNIPConfig(fp4_fraction=fraction, target_scope=s.target_scope))


def policy_formats(s: Setup, policy: str) -> tuple[str, ...]:
    """The candidate formats a policy's run converts its layers for: the setting's, and nvfp4 for the recipe."""
    return tuple(dict.fromkeys(s.candidates + (("nvfp4",) if policy == "nvfp4_recipe" else ())))


def policy_callback(s: Setup, policy: str, fraction: float, seed: int, measured: dict):
    """The SNIPCallback a run trains with: SNIP's (planning from its own rounds) or a fixed plan's (replan off)."""
    from lightning_snip.callback import SNIPCallback
    from lightning_snip.config import SNIPConfig

    base, _, lam = policy.partition("@")  # "snip_gemm@0.3": SNIP with weight_divergence_weight 0.3
    # "snip_gemm+rows2048": SNIP with max_rows 2048 (since 2026-12-04 also the first-order sample's rows; the
    # committed rows2048 study sampled 1024 rows there, the then default of first_order_rows)
    base, *modifiers = base.split("+")
    max_rows = next((int(m[len("rows"):]) for m in modifiers if m.startswith("rows")), s.max_rows)
    # "snip_gemm+every60": rounds every 60 steps instead of the setting's snip_interval (fewer rounds: issue 50)
    interval = next((int(m[len("every"):]) for m in modifiers if m.startswith("every")), s.snip_interval)
    granularity = "gemm" if base.endswith("_gemm") or base == "backward_only" else "layer"
    # Every config but +ships sets its granularity and target_scope=model: the fractions are shares of the whole model's
    # linear FLOPs (the pinned head's included), as the committed results were measured; and the spike guard
    # off (spike_threshold=None), as it did not exist then: a revert would make a run incomparable; and the fixed
    # schedule (overhead_budget=None): the protocol's rounds every snip_interval steps, as the results were measured.
    if base in ("snip", "snip_gemm") and "ships" in modifiers:
        # "snip_gemm+ships": SNIP exactly as it ships (issue 63's FP4 candidate study): every SNIPConfig default,
        # the target on the switchable layers (target_scope's default) included, but for the setting's formats and
        # pins, its CPU-sized rows, and the first round at the checkpoint, where every policy's plan starts.
        # (quality v5: the first round after s.plan_start steps of warm-up, its first-order sample before it)
        config = SNIPConfig(warmup_steps=s.plan_start, fp4_fraction=fraction, candidate_formats=s.candidates, pins=PINS,
                            granularity=granularity, max_rows=max_rows)
        return SNIPCallback(config)
    elif base in ("snip", "snip_gemm") and "defaults" in modifiers:
        # "snip_gemm+defaults": SNIP as it ships (issue 52): the library's defaults (its schedule, overhead budget,
        # first-order sample, spike guard) but for the protocol's target (fraction of the whole model, its formats
        # and pins), its CPU-sized rows, and the first round at the checkpoint, where every policy's plan starts.
        # (SNIP's schedule counts from the step it is resumed at: warmup_steps=0 puts the first round there)
        config = SNIPConfig(warmup_steps=0, fp4_fraction=fraction, target_scope="model",
                            candidate_formats=s.candidates, pins=PINS, granularity=granularity, max_rows=max_rows)
        return SNIPCallback(config)
    elif base in ("snip", "snip_gemm"):
        # The first round runs at the checkpoint (no first-order history yet), then every interval.
        config = SNIPConfig(warmup_steps=0, interval=interval, fp4_fraction=fraction,
                            target_scope="model", candidate_formats=s.candidates, initial_format="fp8", pins=PINS,
                            granularity=granularity, first_order_steps=min(s.first_order_steps, s.snip_interval - 1),
                            max_rows=max_rows, spike_threshold=None,
                            overhead_budget=None,
                            **({"weight_divergence_weight": float(lam)} if lam else {}))
        return SNIPCallback(config)
    else:
        plan = fixed_plan(policy, fraction, seed, run_module(s), s, measured)
        late = late_plan(s, policy)  # quality v5: in SNIP's initial format (fp8) until SNIP's first plan's step
        callback = SNIPCallback(SNIPConfig(replan=False, fp4_fraction=0.0 if late else fraction or 0.0,
                                           target_scope="model", pins=PINS, spike_threshold=None,
                                           granularity=granularity, candidate_formats=policy_formats(s, policy)),
                                plan=None if late else plan)
        callback.late_plan = plan if late else None  # (run_one applies it at late_plan_step)
        return callback


def late_plan(s: Setup, policy: str) -> bool:
    """Whether the policy's fixed plan applies after s.plan_start steps (an FP4 policy under a v5 setting) rather
    than from the checkpoint (every policy before v5, and all_bf16 / all_fp8: the references, unchanged)."""
    return s.plan_start > 0 and not policy.startswith("all_")


def late_plan_step(s: Setup) -> int:
    """The global step a late fixed plan applies at: SNIP's first plan's (its first round at the checkpoint's step +
    warmup_steps, its plan applied lightning_snip.budget.APPLY_DELAY steps later)."""
    from lightning_snip.budget import APPLY_DELAY

    return s.pretrain_steps + s.plan_start + APPLY_DELAY


def run_one(s: Setup, ckpt: str, policy: str, fraction: float, seed: int, measured: dict, root: str) -> dict:
    """Continue from the checkpoint under one policy; return the held-out loss (high precision)."""
    import lightning.pytorch as pl
    import torch

    from lightning_snip.convert import high_precision

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*(LeafSpec|dataloader is not resumable).*")
    torch.set_num_threads(1)
    if s.model in PRETRAINED:
        _pretrained(s.model)  # loaded once per worker, before the seed: every run's random streams start alike
    pl.seed_everything(seed)
    module = run_module(s, continuation=True)
    callback = policy_callback(s, policy, fraction, seed, measured)
    data = data_module(s, seed)
    trajectory = _Trajectory(s, callback, data) if s.trajectory_every else None
    late = _LatePlan(late_plan_step(s), callback.late_plan) if getattr(callback, "late_plan", None) else None
    start = time.perf_counter()
    trainer = _trainer(s, s.pretrain_steps + s.continue_steps, [callback] + [c for c in (late, trajectory) if c],
                       Path(root))
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    seconds = time.perf_counter() - start - (trajectory.seconds if trajectory else 0.0)

    with high_precision(callback.layers):
        eval_loss = held_out_loss(module, data)  # the trained weights, evaluated in high precision (the headline)
    eval_loss_plan = held_out_loss(module, data)  # ... and with every forward GEMM in its plan's format (serving in it)
    plan = late.plan if late else callback.plan
    extra = {"oracle_lambda": oracle_lambda(policy)} if policy.startswith("oracle") else {}
    history = callback.controller.history
    if late:  # the step its fixed plan applied at
        extra["first_plan_step"] = late.applied_at
    elif s.plan_start and history and callback.num_plans_applied:  # SNIP's first plan: its first round's + the delay
        from lightning_snip.budget import APPLY_DELAY

        extra["first_plan_step"] = history[0]["step"] + APPLY_DELAY
    if trajectory:  # [continuation step, high-precision held-out loss], the end's included
        extra["trajectory"] = trajectory.points + [[s.continue_steps, eval_loss]]
        extra["eval_seconds"] = trajectory.seconds
        guard = callback.controller.guard
        extra["reverts"] = guard.num_reverts if guard is not None else 0
    if history:  # SNIP's estimates at its first round (the checkpoint): the objective study prices plans with them
        extra["estimates"] = {metric: {f"{fqn}|{fmt}": v for fqn, d in history[0]["divergence"]["layers"].items()
                                       for fmt, v in d.get(metric, {}).items()}
                              for metric in ("loss_divergence", "weight_divergence")}
    return {"policy": policy, "fraction": fraction, "seed": seed, "eval_loss": eval_loss, "eval_loss_plan": eval_loss_plan, **extra,
            "achieved_fraction": plan.fp4_fraction if plan else 0.0, "seconds": seconds,
            "plans": callback.num_plans_applied + bool(late and late.applied_at is not None), "plan": {k: f.value for k, f in plan.items()} if plan else {}}


def _LatePlan(step: int, plan):
    """A callback (made in the worker, as _Trajectory) that applies a fixed plan at the start of global step ``step``
    (lightning_snip.convert.apply_plan, before the step's forward): quality v5's fixed policies, switched at the step
    SNIP's first plan is; ``applied_at`` the step it did."""
    import lightning.pytorch as pl

    from lightning_snip.convert import apply_plan

    class LatePlan(pl.Callback):
        def __init__(self):
            self.plan, self.applied_at = plan, None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.applied_at is None and trainer.global_step >= step:
                apply_plan(pl_module, self.plan)
                self.applied_at = trainer.global_step

    return LatePlan()


def _Trajectory(s: Setup, snip, data):
    """A callback (made in the worker: Lightning's base class is imported there) that evaluates the held-out loss in
    high precision every ``s.trajectory_every`` continuation steps, after the step's callbacks (SNIP's timing has
    closed the step: the evaluation is not SNIP's or training's time); its own seconds are kept apart."""
    import lightning.pytorch as pl

    from lightning_snip.convert import high_precision

    class Trajectory(pl.Callback):
        def __init__(self):
            self.points, self.seconds = [], 0.0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step - s.pretrain_steps
            if 0 < step < s.continue_steps and step % s.trajectory_every == 0 and (
                    not self.points or self.points[-1][0] != step):
                t = time.perf_counter()
                with high_precision(snip.layers):
                    self.points.append([step, held_out_loss(pl_module, data)])
                self.seconds += time.perf_counter() - t

    return Trajectory()


def jobs_for(fractions, seeds: int, policies=FRACTION_POLICIES, uniform=True, natural: dict | None = None,
             natural_seeds: int | None = None):
    """``natural``: the fixed rules' own fractions (industry_tail: its protected blocks alone;
    backward_only: every backward GEMM), at which SNIP and the oracle (of that rule's granularity) run
    beside them, so each rule is also compared as itself and not only extended to 0.75 / 0.9 (seeds:
    ``natural_seeds``, default ``seeds``)."""
    jobs = [("all_bf16", 0.0)]
    if uniform:
        jobs += [("all_fp8", 0.0), ("all_fp4", 1.0), ("backward_only", 2.0 / 3.0)]
    jobs += [(p, f) for f in fractions for p in policies]
    out = [(p, f, seed) for seed in range(seeds) for p, f in jobs]
    if natural:
        extra = [(p, natural["industry_tail"]) for p in ("industry_tail", "snip", "oracle")]
        extra += [(p, natural["backward_only"]) for p in ("snip_gemm", "oracle_gemm")]
        out += [(p, f, seed) for seed in range(seeds if natural_seeds is None else natural_seeds) for p, f in extra]
    return out


def natural_fractions(s: Setup) -> dict[str, float]:
    """The FP4 fractions (of the whole model's linear FLOPs) the industry rule, backward-only FP4 and the NVFP4
    recipe reach by themselves on this model."""
    from lightning_snip.baselines import backward_only_plan, natural_fp4_fraction, nvfp4_recipe_plan

    cands = plan_candidates(run_module(s), None, s.candidates)
    recipe = nvfp4_recipe_plan(plan_candidates(run_module(s), None, policy_formats(s, "nvfp4_recipe")))
    return {"industry_tail": round(natural_fp4_fraction(cands), 6),
            "backward_only": round(backward_only_plan(cands, low=s.low).fp4_fraction, 6),
            "nvfp4_recipe": round(recipe.fp4_fraction, 6)}


def _key(row) -> str:
    if row["policy"] in ("all_bf16", "all_fp8"):
        return "0.0"
    if row["policy"] == "all_fp4":
        return "1.0"
    if row["policy"] in NATURAL:
        return f"{round(row['achieved_fraction'], 3):g}"
    return f"{round(row['fraction'], 3):g}"


def summarize(rows: list[dict], metric: str = "eval_loss") -> dict:
    """{"<fraction>": {"<policy>": {"mean", "std", "seeds": [gap per seed, in seed order], "seed_ids"}}}; gaps of
    ``metric`` (eval_loss: high-precision eval; eval_loss_plan: forward GEMMs in the plan's formats) to
    the same seed's all_bf16 run."""
    bf16 = {r["seed"]: r[metric] for r in rows if r["policy"] == "all_bf16"}
    out: dict[str, dict] = {}
    for r in sorted(rows, key=lambda r: r["seed"]):
        if metric in r:
            out.setdefault(_key(r), {}).setdefault(r["policy"], {})[r["seed"]] = r[metric] - bf16[r["seed"]]
    return {
        frac: {name: {"mean": statistics.fmean(g.values()), "std": statistics.stdev(g.values()) if len(g) > 1 else 0.0,
                      "seeds": list(g.values()), "seed_ids": list(g)}
               for name, g in sorted(policies.items())}
        for frac, policies in sorted(out.items(), key=lambda kv: float(kv[0]))
    }


def paired(a: dict, b: dict) -> tuple[float, float, float, int]:
    """(mean, std, t, n) of a's gap minus b's over the seeds both ran (two summary entries): a seed's
    runs share its data order, so the differences pair."""
    theirs = dict(zip(b["seed_ids"], b["seeds"]))
    diffs = [g - theirs[i] for i, g in zip(a["seed_ids"], a["seeds"]) if i in theirs]
    if not diffs:
        return float("nan"), float("nan"), float("nan"), 0
    sd = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
    t = statistics.fmean(diffs) / (sd / math.sqrt(len(diffs))) if len(diffs) > 1 and sd > 0 else float("nan")
    return statistics.fmean(diffs), sd, t, len(diffs)


def verdicts(summary: dict) -> list[str]:
    """The issue's targets, from the summary: headroom capture, gemm vs the best per-layer baseline, and
    SNIP at 0.9 against every baseline."""
    lines = []
    for frac, pol in summary.items():
        base = {p: pol[p] for p in BASELINES if p in pol}
        if not base:  # (the oracle's lines need its runs; the others not: an interim report before its truths)
            continue
        best_name = min(base, key=lambda p: base[p]["mean"])
        best = base[best_name]["mean"]
        best_layer = min((p for p in PER_LAYER if p in pol), key=lambda p: pol[p]["mean"], default=None)
        rules = {p: pol[p] for p in FIXED_RULES if p in pol}
        rule = min(rules, key=lambda p: rules[p]["mean"]) if rules else None
        for oracle in ("oracle", "oracle_gemm", "oracle_pooled", "oracle_pooled_gemm"):
            if rule is not None and oracle in pol:
                diff = rules[rule]["mean"] - pol[oracle]["mean"]
                sd = math.hypot(pol[oracle]["std"], rules[rule]["std"])
                t = paired(rules[rule], pol[oracle])[2]  # paired by seed too: a seed's data order is shared by both runs
                lines.append(f"oracle_headroom {frac} {oracle} {best - pol[oracle]['mean']:+.5f} over best baseline "
                             f"{best_name}; over best fixed rule {rule}: {diff:+.5f} "
                             f"({diff / sd if sd else float('inf'):.1f} std; paired over seeds t {t:.1f}; target > 2 std at 0.75)")
        # Per granularity: snip / oracle against the per-layer baselines, the gemm pair against all.
        for snip, oracle, ref_name in (("snip", "oracle", best_layer), ("snip_gemm", "oracle_gemm", best_name)):
            if snip in pol and oracle in pol and ref_name is not None:
                ref = pol[ref_name]["mean"]
                room = ref - pol[oracle]["mean"]
                room_sd = math.hypot(pol[oracle]["std"], pol[ref_name]["std"])
                capture = (ref - pol[snip]["mean"]) / room if room > 0 else float("nan")
                noise = (" (no room: the oracle is no better than the best baseline)" if room <= 0 else
                         " (room within noise: the ratio means little)" if room <= room_sd else "")
                lines.append(f"headroom_capture {frac} {snip} {capture:.2f} (best baseline {ref_name} {ref:+.5f}, "
                             f"{snip} {pol[snip]['mean']:+.5f}, {oracle} {pol[oracle]['mean']:+.5f}; room {room:+.5f} "
                             f"± {room_sd:.5f}{noise}; target >= 0.7 at 0.75)")
        per_layer = [p for p in PER_LAYER if p in pol]
        if "snip_gemm" in pol and per_layer:
            b = min(per_layer, key=lambda p: pol[p]["mean"])
            lines.append(f"gemm_vs_layer_baseline {frac} {pol['snip_gemm']['mean'] / pol[b]['mean']:.2f} "
                         f"(snip_gemm {pol['snip_gemm']['mean']:+.5f} / {b} {pol[b]['mean']:+.5f}; target <= 0.5 at 0.75)")
        if "snip" in pol and "snip_gemm" in pol:  # issue 12's targets
            lines.append(f"gemm_vs_layer_snip {frac} {pol['snip_gemm']['mean'] / pol['snip']['mean']:.2f} "
                         f"(snip_gemm {pol['snip_gemm']['mean']:+.5f} / snip {pol['snip']['mean']:+.5f}; target <= 0.5 at 0.75)")
            others = [p for p in ("snip",) + PER_LAYER if p in pol]
            margins = [(p, (pol[p]["mean"] - pol["snip_gemm"]["mean"]) / max(pol[p]["std"], pol["snip_gemm"]["std"], 1e-12))
                       for p in others]
            worst = min(margins, key=lambda m: m[1])
            lines.append(f"gemm_beats_every_per_layer_policy {frac} {'yes' if worst[1] > 1 else 'no'} "
                         f"(smallest margin {worst[1]:.1f} std, vs {worst[0]}; target yes at 0.9)")
        for snip in ("snip", "snip_gemm"):
            if snip in pol and rule is not None:  # issue 32's target: > 2 paired std better than the best rule
                mean, sd, t, n = paired(rules[rule], pol[snip])
                lines.append(f"snip_vs_best_rule {frac} {snip} {mean:+.5f} better than {rule} (paired over {n} seeds: "
                             f"std of the differences {sd:.5f}, {mean / sd if sd else float('nan'):.1f} std, t {t:.1f}; "
                             f"target > 2 std at 0.75)")
            if snip in pol:
                margins = [(p, (base[p]["mean"] - pol[snip]["mean"]) / max(base[p]["std"], pol[snip]["std"], 1e-12))
                           for p in base]
                worst = min(margins, key=lambda m: m[1])
                lines.append(f"beats_every_baseline {frac} {snip} {'yes' if worst[1] > 1 else 'no'} "
                             f"(smallest margin {worst[1]:.1f} std, vs {worst[0]})")
    return lines


def run_jobs(s: Setup, ckpt, measured, jobs, store: Path, workers: int, root: Path, truths=None,
             cached_only: bool = False, heavy=None) -> list[dict]:
    """Runs the jobs not yet in ``store``/rows.jsonl (appending each finished row there as it ends);
    returns the rows of all the jobs. ``truths``: a callable that adds the oracle's truths to
    ``measured`` when they are missing (SmolLM2's, measured after every other job: a session cut off
    before them has its other runs). ``cached_only``: run nothing, return the cached rows (an interim
    report of a benchmark that takes more than a session). ``heavy``: a predicate on a job; at most one
    such job runs at a time (next_job)."""
    done_path = store / "rows.jsonl"
    done, stale = {}, 0
    if done_path.exists():
        for line in done_path.read_text().splitlines():
            row = json.loads(line)
            # An oracle run made at another lambda (the default changed from 1 to SNIP's 0.1) is not this job.
            if row["policy"].startswith("oracle") and row.get("oracle_lambda") != oracle_lambda(row["policy"]):
                stale += 1
                continue
            done[row["policy"], row["fraction"], row["seed"]] = row
    if stale:
        print(f"# {stale} cached oracle runs made at another lambda than this code's: run again", flush=True)
    rows = [done[job] for job in jobs if job in done]
    jobs = [job for job in jobs if job not in done]
    if rows:
        print(f"# reusing {len(rows)} finished runs from {done_path}", flush=True)
    if cached_only:
        print(f"# --cached-only: {len(jobs)} jobs not run ({sorted({j[0] for j in jobs})})", flush=True)
        return rows
    needs_truths = [job for job in jobs if job[0].startswith("oracle")] if "truths" not in measured else []
    batches = [[job for job in jobs if job not in needs_truths], needs_truths]
    ctx = multiprocessing.get_context("spawn")
    # SmolLM2: a fresh process per run (its load, ~20 s, is cheaper than what a reused worker's heap
    # grows to: a worker reached 10.5 GB and two of them with the main process ran out of 24 GB on
    # 2026-12-02); the demo's workers are reused.
    per_run = 1 if s.model in PRETRAINED else None
    with futures.ProcessPoolExecutor(workers, mp_context=ctx, max_tasks_per_child=per_run) as pool:
        for batch in batches:
            if batch is needs_truths and batch:
                truths()
            queue, running = list(batch), {}
            while queue or running:
                while len(running) < workers and (i := next_job(queue, running.values(), heavy)) is not None:
                    job = queue.pop(i)
                    running[pool.submit(run_one, s, str(ckpt), *job, measured, str(root))] = job
                finished, _ = futures.wait(running, return_when=futures.FIRST_COMPLETED)
                for fut in finished:
                    del running[fut]
                    row = fut.result()
                    rows.append(row)
                    with done_path.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"{row['policy']:<14} frac {row['fraction']:.2f} seed {row['seed']} eval {row['eval_loss']:.4f} "
                          f"achieved {row['achieved_fraction']:.3f} plans {row['plans']} {row['seconds']:.0f}s", flush=True)
    return rows


def next_job(queue: list[tuple], running, heavy=None) -> int | None:
    """The index in ``queue`` of the job to start next: the first, except that while a ``heavy`` job runs (a
    predicate on a job; None: none is) the first job that is not heavy (None: none may start now): for runs too large
    in memory to pair (quality_v5.heavy_jobs)."""
    busy = heavy is not None and any(heavy(job) for job in running)
    return next((i for i, job in enumerate(queue) if not (busy and heavy(job))), None)


def complete_seeds(rows: list[dict], jobs) -> list[dict]:
    """The rows of the seeds that have finished every job of the policies with any finished run (the
    oracles' runs come last, after their truths): each policy's gaps then pair over one seed set."""
    done = {(r["policy"], r["fraction"], r["seed"]) for r in rows}
    started = {r["policy"] for r in rows}
    jobs = [j for j in jobs if j[0] in started]
    seeds = {j[2] for j in jobs} - {j[2] for j in jobs if j not in done}
    print(f"# complete seeds: {sorted(seeds)}", flush=True)
    return [r for r in rows if r["seed"] in seeds]


def table(summary: dict) -> list[str]:
    out = ["| fraction | policy | gap to bf16 (mean) | std | per seed |", "|---|---|---|---|---|"]
    for frac, policies in summary.items():
        for name, v in sorted(policies.items(), key=lambda kv: kv[1]["mean"]):
            out.append(f"| {frac} | {name} | {v['mean']:+.5f} | {v['std']:.5f} | "
                       + " ".join(f"{g:+.4f}" for g in v["seeds"]) + " |")
    return out


def plan_objective(plan: dict, prices: dict, lam: float) -> float:
    """The ILP's objective of a plan priced with ``prices`` ({"loss_divergence" / "weight_divergence":
    {"<fqn>|<format>": value}}): forward GEMMs by LD, backward GEMMs by lambda x WD, each clamped at 0
    as the planner does; a per-layer plan pays both for its one format."""
    total = 0.0
    for key, fmt in plan.items():
        fqn, _, direction = key.partition(":")
        if fmt == "bf16":
            continue
        if direction in ("", "forward"):
            total += max(0.0, prices["loss_divergence"].get(f"{fqn}|{fmt}", 0.0))
        if direction in ("", "backward"):
            total += lam * max(0.0, prices["weight_divergence"].get(f"{fqn}|{fmt}", 0.0))
    return total


def snip_estimates(rows: list[dict]) -> dict | None:
    """SNIP's estimates at the checkpoint: the mean over the SNIP runs (every seed, both granularities)
    of their first round's LD and WD, which all ran at the checkpoint (only their random draws differ)."""
    found = [r["estimates"] for r in rows if r.get("estimates")]
    if not found:
        return None
    return {metric: {key: statistics.fmean(e[metric][key] for e in found if key in e[metric])
                     for key in found[0][metric]} for metric in ("loss_divergence", "weight_divergence")}


def outcome_ceiling(runs: list[dict], gap) -> float:
    """How well the gaps themselves rank the plans across seeds: over the policies run with >= 2
    seeds, Spearman between the mean gap of the first half of each policy's seeds and of the rest (the
    seed noise's bound on any objective's Spearman with single runs' gaps)."""
    from scipy.stats import spearmanr

    by: dict[str, list[tuple[int, float]]] = {}
    for r in runs:
        by.setdefault(r["policy"], []).append((r["seed"], gap(r)))
    pairs = []
    for values in by.values():
        values.sort()
        if len(values) >= 2:
            half = len(values) // 2
            pairs.append((statistics.fmean(v for _, v in values[:half]), statistics.fmean(v for _, v in values[half:])))
    if len(pairs) < 3:
        return float("nan")
    return float(spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic)


def objective_study(rows: list[dict], measured: dict) -> list[str]:
    """Does the ILP's objective predict a plan's outcome? Per run (every fixed-plan and SNIP run at a
    fraction strictly between 0 and 1, backward_only aside): the plan's objective (plan_objective)
    priced with the oracle's truths and with SNIP's own estimates at the checkpoint (snip_estimates),
    against its measured gap; Spearman over the runs at each fraction, over all of them and per
    granularity (layer: per-layer plans, gemm: per-GEMM plans), for each eval precision, beside the
    gaps' own seed-split ceiling. A SNIP run is priced by its last plan (its earlier plans held for
    part of the run)."""
    from scipy.stats import spearmanr

    lam = oracle_lambda("oracle")
    pricings = {"truths": measured.get("truths"), "snip_estimates": snip_estimates(rows)}
    pricings = {k: v for k, v in pricings.items() if v}
    bf16 = {m: {r["seed"]: r[m] for r in rows if r["policy"] == "all_bf16" and m in r} for m in ("eval_loss", "eval_loss_plan")}
    lines = []
    for frac in sorted({r["fraction"] for r in rows if 0 < r["fraction"] < 1 and r["policy"] != "backward_only"}):
        at = [r for r in rows if r["fraction"] == frac and r["plan"] and r["policy"] != "backward_only"]
        for granularity, runs in (("all", at), ("layer", [r for r in at if not any(":" in k for k in r["plan"])]),
                                  ("gemm", [r for r in at if any(":" in k for k in r["plan"])])):
            for metric in ("eval_loss", "eval_loss_plan"):
                if not all(metric in r and r["seed"] in bf16[metric] for r in runs) or len(runs) < 3:
                    continue

                def gap(r, metric=metric):
                    return r[metric] - bf16[metric][r["seed"]]

                y = [gap(r) for r in runs]
                for name, prices in pricings.items():
                    x = [plan_objective(r["plan"], prices, lam) for r in runs]
                    lines.append(f"objective_vs_gap {frac:g} {granularity} {metric} {name} {spearmanr(x, y).statistic:.2f} "
                                 f"over {len(runs)} runs (the ILP objective at lambda {lam:g} vs the run's gap; gaps' "
                                 f"seed-split ceiling {outcome_ceiling(runs, gap):.2f})")
    return lines


# The classes of FP4 GEMMs the structure study fits a gap on: (name, direction, which GEMMs, by the
# layer's fqn, block and the first and last block). A class after the first of its direction is an
# excess over it (its GEMMs count in that first class too). FP4 formats are not told apart: only the
# SNIP and oracle runs mix mxfp4 in, so a format column would price those policies, not the format.
STRUCTURE_FEATURES = (
    ("forward FP4", "forward", lambda fqn, block, first, last: True),
    ("+ attention (forward)", "forward", lambda fqn, block, first, last: "attn." in fqn),  # demo attn., HF self_attn.
    ("+ first block (forward)", "forward", lambda fqn, block, first, last: block == first),
    ("+ last block (forward)", "forward", lambda fqn, block, first, last: block == last and last != first),
    ("backward FP4", "backward", lambda fqn, block, first, last: True),
)
# The columns that together hold a plan's whole FP4 share: the first class of each direction.
_FP4_TOTAL = tuple(i for i, (name, _, _) in enumerate(STRUCTURE_FEATURES) if not name.startswith("+"))


def _direction_share(direction: str) -> float:
    """A GEMM direction's share of its layer's FLOPs ("" = the whole layer), as the planner splits them."""
    from lightning_snip.planner import FORWARD_SHARE

    return {"": 1.0, "forward": FORWARD_SHARE, "backward": 1.0 - FORWARD_SHARE}[direction]


def plan_shares(plan: dict, flops: dict[str, float]) -> list[float]:
    """A run's plan as the shares of the unpinned linear FLOPs (6 x in x out per layer: forward 1/3,
    backward 2/3, planner.FORWARD_SHARE) in FP4 in each of STRUCTURE_FEATURES' classes."""
    from lightning_snip.baselines import block_index

    total = sum(flops.values())
    blocks = [b for b in map(block_index, flops) if b is not None]
    first, last = (min(blocks), max(blocks)) if blocks else (None, None)
    out = [0.0] * len(STRUCTURE_FEATURES)
    for key, fmt in plan.items():
        fqn, _, direction = key.partition(":")
        if fqn not in flops or fmt not in ("mxfp4", "nvfp4"):
            continue
        block = block_index(fqn)
        for d in ((direction,) if direction else ("forward", "backward")):
            share = flops[fqn] * _direction_share(d) / total
            for i, (_, where, member) in enumerate(STRUCTURE_FEATURES):
                out[i] += share if where == d and member(fqn, block, first, last) else 0.0
    return out


def structure_study(rows: list[dict], s: Setup) -> list[str]:
    """What kind of choice moves the gap? Least squares of the fixed-plan runs' gaps on their plans'
    FP4 FLOP shares per class (STRUCTURE_FEATURES), with one offset per seed (a seed's data order is
    shared by its runs). SNIP's runs change plans every interval: they stay out of the fit, and their
    residual (priced by their last plan) is what SNIP gained (negative) or lost against the classes of
    the plan it ended with; a fixed policy's mean residual is what its choices within the classes
    gained or lost. If the classes explain the gaps down to the seed noise, plans that agree on the
    classes are equivalent, and a rule that orders the classes right leaves an oracle little headroom."""
    import numpy as np

    flops = {c.fqn: c.flops for c in plan_candidates(run_module(s), None, s.candidates) if c.pinned is None}
    names = [n for n, _, _ in STRUCTURE_FEATURES]
    lines = []
    for metric in ("eval_loss", "eval_loss_plan"):
        bf16 = {r["seed"]: r[metric] for r in rows if r["policy"] == "all_bf16" and metric in r}
        seeds = sorted(bf16)
        # all_bf16's gap is 0 by construction: not a measurement.
        runs = [r for r in rows if r.get("plan") and r["policy"] != "all_bf16" and metric in r and r["seed"] in bf16]
        fixed = [r for r in runs if not r["policy"].startswith("snip")]
        if not runs:  # no run measured this metric
            continue

        def design(rs):
            return np.array([plan_shares(r["plan"], flops) + [float(r["seed"] == seed) for seed in seeds] for r in rs])

        x = design(fixed).reshape(len(fixed), len(names) + len(seeds))
        rank = int(np.linalg.matrix_rank(x)) if len(fixed) else 0
        if len(fixed) <= x.shape[1] or rank < x.shape[1]:
            lines.append(f"structure {metric}: not fitted: {len(fixed)} fixed-plan runs, design rank {rank} of "
                         f"{len(names) + len(seeds)} (needs runs at several fractions, e.g. the uniform ones)")
            continue
        y = np.array([r[metric] - bf16[r["seed"]] for r in fixed])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        resid = y - x @ coef
        r2 = 1 - float(resid @ resid) / float(((y - y.mean()) ** 2).sum())
        lines.append(f"structure {metric}: R2 {r2:.2f} over {len(fixed)} fixed-plan runs, residual std "
                     f"{resid.std(ddof=x.shape[1]):.5f}; gap per unit FLOP share in FP4: "
                     + ", ".join(f"{n} {c:+.4f}" for n, c in zip(names, coef)))
        all_resid = np.array([r[metric] - bf16[r["seed"]] for r in runs]) - design(runs) @ coef
        by_policy: dict[str, list[float]] = {}
        for r, e in zip(runs, all_resid):
            by_policy.setdefault(r["policy"], []).append(float(e))
        lines.append(f"structure {metric} mean residual by policy (n; snip* out of the fit, by their last plan): " + ", ".join(
            f"{p} {statistics.fmean(v):+.5f} ({len(v)})" for p, v in sorted(by_policy.items(), key=lambda kv: statistics.fmean(kv[1]))))
        offset = float(np.mean(coef[len(names):]))
        lines += _structural_headroom(fixed, y, coef[:len(names)], offset, flops, metric)
    return lines


def _structural_headroom(runs: list[dict], gaps, coef, offset: float, flops: dict[str, float], metric: str) -> list[str]:
    """Under the fit: the best plan with the best fixed rule's FP4 share (per layer and per GEMM: FP4
    to the GEMMs the fit prices lowest per FLOP, fractionally at the margin: the exact minimum of the
    fitted cost at that share, each GEMM's cost clamped at 0) against the fitted gap of that rule's own
    plan, both with the mean seed offset, the difference in units of the hypot of two of the rule's
    seed stds (as oracle_headroom compares an oracle with a rule). It is the fit's answer, within the
    fit's own residual error."""
    total, clamped = sum(flops.values()), 0
    items = {}  # granularity -> (fitted cost per unit share, share), cheapest first
    for granularity, directions in (("layer", ("",)), ("gemm", ("forward", "backward"))):
        priced = []
        for fqn in flops:
            for d in directions:
                share = flops[fqn] * _direction_share(d) / total
                cost = sum(c * x for c, x in zip(coef, plan_shares({f"{fqn}:{d}" if d else fqn: "nvfp4"}, flops)))
                clamped += cost < 0
                # A GEMM whose FP4 the fit prices below 0 is priced 0: FP4 is not taken to help.
                priced.append((max(cost, 0.0) / share, share))
        items[granularity] = sorted(priced)
    lines = []
    for frac in sorted({r["fraction"] for r in runs if 0 < r["fraction"] < 1}):
        here = [(r, g) for r, g in zip(runs, gaps) if r["fraction"] == frac]
        rules = {p: [g for r, g in here if r["policy"] == p] for p in FIXED_RULES}
        rules = {p: g for p, g in rules.items() if len(g) > 1}
        if not rules:
            continue
        rule = min(rules, key=lambda p: statistics.fmean(rules[p]))
        shares = plan_shares(next(r["plan"] for r, _ in here if r["policy"] == rule), flops)
        fitted_rule = offset + sum(c * x for c, x in zip(coef, shares))
        parts = {}
        for granularity, priced in items.items():
            need, best = sum(shares[i] for i in _FP4_TOTAL), offset
            for per_share, share in priced:
                take = min(share, need)
                best, need = best + per_share * take, need - take
                if need <= 1e-12:
                    break
            parts[granularity] = best
        sd = math.sqrt(2) * statistics.stdev(rules[rule])
        best = min(parts.values())
        lines.append(f"structure {metric} headroom {frac:g}: the fit's best plan at {rule}'s FP4 share "
                     f"{sum(shares[i] for i in _FP4_TOTAL):.3f} of the unpinned FLOPs (layer {parts['layer']:+.5f}, "
                     f"gemm {parts['gemm']:+.5f}) vs {rule}'s plan fitted {fitted_rule:+.5f} (measured "
                     f"{statistics.fmean(rules[rule]):+.5f}): {fitted_rule - best:+.5f} = "
                     f"{(fitted_rule - best) / sd if sd else float('inf'):.1f} std (hypot of two of the rule's seed stds)"
                     + (f"; {clamped} GEMM items the fit prices below 0 priced 0" if clamped else ""))
    return lines


def setting_record(s: Setup) -> dict:
    out = json.loads(json.dumps(asdict(s)))  # as the JSON cache holds it (tuples as lists)
    for name, default in (("trajectory_every", 0), ("plan_start", 0), ("target_scope", "model")):
        if out[name] == default:
            del out[name]  # the settings cached before the field existed stay the same setting
    return out


def results_prefix(name: str) -> str:
    """The results files' name: compare_policies_v2* (the demo's settings), compare_policies_<setting>*
    for SmolLM2's (issue 32: compare_policies_smollm2*, the GPU protocol's compare_policies_smollm2_gpu*)."""
    return f"compare_policies_{name}" if SETTINGS[name].model in PRETRAINED else "compare_policies_v2"


def wall_times(rows: list[dict]) -> str:
    """Wall time per run (mean by kind of policy) and in all, from the rows' own timings."""
    kinds: dict[str, list[float]] = {}
    for r in rows:
        kind = "snip" if r["policy"].startswith("snip") else "all_bf16" if r["policy"] == "all_bf16" else "fixed plan"
        kinds.setdefault(kind, []).append(r["seconds"])
    return ("wall time per run (fit, 1 thread; mean): " + ", ".join(f"{k} {statistics.fmean(v):.0f} s ({len(v)} runs)"
            for k, v in sorted(kinds.items())) + f"; all runs {sum(r['seconds'] for r in rows) / 60:.1f} min")


def quick_setting(name: str) -> str:
    return f"{name}_quick" if f"{name}_quick" in SETTINGS else "quick"


def release_memory() -> None:
    """Collect cycles and hand freed heap pages back to the OS (glibc's malloc_trim; a no-op elsewhere)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def prepare(s: Setup, work: Path, store: Path, truths: bool = True) -> tuple[Path, dict]:
    """The checkpoint and its measurements, from the cache where they are this setting's. The
    pretraining (seed 1234) is deterministic: a checkpoint regenerated in a later session (the
    checkpoint lives in ``work``, the measurements and runs in ``store``) whose fingerprint matches
    the cached one (same_checkpoint) keeps the cached truths and runs; any other discards them (renamed *_stale_*), so a
    changed protocol never reuses a stale run. The cache does not know the code: after changing
    lightning_snip or run_one, use a fresh store."""
    cache, ckpt = store / "measured.json", work / "pretrained.ckpt"
    cached = json.loads(cache.read_text()) if cache.exists() else None
    if cached is not None and cached["setting"] != setting_record(s):
        cached = None
    if cached is not None and ckpt.exists() and "fingerprint" in cached["measured"]:
        return ckpt, cached["measured"]
    ckpt, measured = pretrain(s, work, with_truths=truths and s.model == "demo")
    if cached is not None and "fingerprint" in cached["measured"] and same_checkpoint(
            measured["fingerprint"], cached["measured"]["fingerprint"]):
        return ckpt, cached["measured"]
    for old in ("rows.jsonl", "truth_parts.json", "rounds.jsonl"):
        if (store / old).exists():  # runs of another setting or checkpoint: never mixed in
            stale = store / f"{Path(old).stem}_stale_{int(time.time())}{Path(old).suffix}"
            (store / old).rename(stale)
            theirs = cached["measured"] if cached is not None else {}
            mine = f"{measured['fingerprint']}, {measured.get('versions', 'versions not recorded')}"
            cached_one = f"{theirs.get('fingerprint', 'another setting')}, {theirs.get('versions', 'versions not recorded')}"
            print(f"# {store.name}: this checkpoint (fingerprint {mine}) is not the cached one ({cached_one}): {old} set "
                  f"aside as {stale.name}", file=sys.stderr, flush=True)
    cache.write_text(json.dumps({"setting": setting_record(s), "measured": measured}))
    return ckpt, measured


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="deep8")
    parser.add_argument("--quick", action="store_true",
                        help="the setting's tiny version ('quick', or '<setting>_quick'), 1 seed, nothing written")
    parser.add_argument("--search", nargs="+", choices=sorted(SETTINGS),
                        help="the setting search: oracle, min_rel_err and the fixed rules at 0.75 in each setting")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.75, 0.9])
    parser.add_argument("--lambdas", type=float, nargs="+", default=[],
                        help="also run snip, snip_gemm, oracle and oracle_gemm at these weight_divergence_weight "
                             "values (policies snip@<lambda>, oracle@<lambda>, ...)")
    parser.add_argument("--policies", nargs="+",
                        help="run only these policies (all_bf16 always runs: the gaps are to it)")
    parser.add_argument("--natural-seeds", type=int, help="seeds of the runs at the rules' natural fractions (default --seeds)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-truths", action="store_true",
                        help="the demo's checkpoint without the oracle's truths (deep8's take ~50 min on 2 cores): "
                             "for --policies studies without the oracle policies")
    parser.add_argument("--cached-only", action="store_true",
                        help="run nothing: report the runs cached under --store (the seeds that every policy has "
                             "finished; an interim result of a benchmark longer than a session)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--store", type=Path, help="where the finished runs (rows.jsonl), the checkpoint's measurements "
                        "and the truths are kept and resumed from (default: benchmarks/results/compare_policies_"
                        "<setting>_cache for SmolLM2, committed; $SNIP_BENCH_DIR/<setting> for the demo's)")
    parser.add_argument("--objective-study", type=Path, metavar="RUNS_JSON",
                        help="from a compare_policies_v2_runs.json: the objective-vs-gap correlation, then exit")
    parser.add_argument("--structure-study", type=Path, metavar="RUNS_JSON",
                        help="from a compare_policies_v2_runs.json: each fixed-plan run's gap fitted on its plan's FP4 "
                             "FLOP shares per GEMM class (forward, attention, first / last block, backward), then exit")
    return parser


def _jobs(args, s: Setup, parser: argparse.ArgumentParser) -> list[tuple]:
    """The (policy, fraction, seed) runs this invocation asks of setting ``s``."""
    seeds = 1 if args.quick else args.seeds
    if args.search:
        jobs = jobs_for([0.75], args.seeds, SEARCH_POLICIES, uniform=False)
    else:
        # SmolLM2: no runs at the rules' natural fractions (a run there costs what one at 0.75 does)
        natural = natural_fractions(s) if s.model == "demo" else None
        jobs = jobs_for(args.fractions, seeds, natural=natural, natural_seeds=args.natural_seeds)
        jobs += [(f"{p}@{lam:g}", f, seed) for seed in range(seeds) for f in args.fractions for lam in args.lambdas
                 for p in ("snip", "snip_gemm", "oracle", "oracle_gemm")]
        # SNIP with max_rows=<n> ("snip_gemm+rows2048") or rounds every <n> steps ("snip_gemm+every60"), only
        # where --policies names it
        named = [p for p in args.policies or () if re.fullmatch(r"snip(_gemm)?\+(rows|every)[1-9]\d*", p)]
        jobs += [(p, f, seed) for p in named for seed in range(seeds) for f in args.fractions]
        if "nvfp4_recipe" in (args.policies or ()):  # the recipe at its own FP4 fraction, where --policies names it
            jobs += [("nvfp4_recipe", natural_fractions(s)["nvfp4_recipe"], seed) for seed in range(seeds)]
    if args.policies:
        unknown = set(args.policies) - {j[0] for j in jobs}
        if unknown:
            parser.error(f"--policies: {sorted(unknown)} not among this invocation's policies "
                         f"{sorted({j[0] for j in jobs})} (snip@<lambda> needs --lambdas <lambda>)")
        jobs = [j for j in jobs if j[0] in set(args.policies) | {"all_bf16"}]
    return jobs


def _measure_truths(s: Setup, ckpt, measured: dict, store: Path) -> None:
    """The oracle's truths at the checkpoint, into ``measured`` and store/measured.json."""
    t = time.perf_counter()
    module, optimizer, data = from_checkpoint(s, ckpt)
    model, layers = truth_model(s, module)
    measured.update(measure_truths(s, model, optimizer, layers, data, parts=store / "truth_parts.json", chunk=30))
    (store / "measured.json").write_text(json.dumps({"setting": setting_record(s), "measured": measured}))
    print(f"# [{s.model}] truths in {time.perf_counter() - t:.0f} s; ceilings "
          + ", ".join(f"{k} {v:.2f}" for k, v in measured["ceilings"].items()), flush=True)


def _setting_lines(name: str, s: Setup, rows: list[dict], measured: dict, t0: float, args) -> list[str]:
    """One setting's section of the report: its wall time, ceilings, table, verdicts and studies."""
    summary = summarize(rows)
    summary_plan = summarize(rows, "eval_loss_plan") if all("eval_loss_plan" in r for r in rows) else {}
    bf16 = [r["eval_loss"] for r in sorted(rows, key=lambda r: r["seed"]) if r["policy"] == "all_bf16"]
    lines = [f"## setting {name}: {asdict(s)}"] + (
        [f"interim (--cached-only): the {len({r['seed'] for r in rows})} seeds every job has finished"]
        if args.cached_only else []) + [
             f"wall {time.perf_counter() - t0:.0f} s (this invocation: pretraining and truths unless cached, and the "
             f"runs not cached); truth ceilings (split-half "
             f"Spearman; loss: batches 1..K/2 vs the rest, weights: SR seeds; nan: one seed) "
             + ", ".join(f"{k} {v:.2f}" for k, v in measured.get("ceilings", {}).items()),
             wall_times(rows),
             f"bf16 eval loss over seeds: mean {statistics.fmean(bf16):.4f}, std "
             f"{statistics.stdev(bf16) if len(bf16) > 1 else 0.0:.5f}", ""] + table(summary) + [""]
    lines += [f"    {v}" for v in verdicts(summary)] + [""]
    if not args.search:
        lines += [f"    {v}" for v in objective_study(rows, measured) + structure_study(rows, s)] + [""]
    if summary_plan:
        lines += ["The same runs evaluated with every forward GEMM in its plan's format (the model served as it "
                  "trained; the oracle's LD truth is this loss's first-order change):", ""]
        lines += table(summary_plan) + [""] + [f"    {v}" for v in verdicts(summary_plan)] + [""]
    if not (args.quick or args.search or args.policies):  # a --policies study leaves the headline files
        _write_headline(args.out, name, s, summary, summary_plan, bf16, rows, measured)
    return lines


def _write_headline(out: Path, name: str, s: Setup, summary: dict, summary_plan: dict, bf16: list[float],
                    rows: list[dict], measured: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    noise = {"bf16_eval_loss_mean": statistics.fmean(bf16), "bf16_eval_loss_std": statistics.stdev(bf16) if len(bf16) > 1 else None,
             "seeds": bf16, "note": "the seed-to-seed spread of the all-bf16 run's eval loss (all_bf16's "
             "own gap is 0 by construction)"}
    prefix = results_prefix(name)
    (out / f"{prefix}.json").write_text(json.dumps(dict(summary, noise_floor=noise), indent=2))
    (out / f"{prefix}_plan_precision.json").write_text(json.dumps(summary_plan, indent=2))
    (out / f"{prefix}_runs.json").write_text(json.dumps({"setting": asdict(s), "measured": measured, "rows": rows}, indent=1))
    plot(summary, out / f"{prefix}.png")


def run_setting(name: str, args, parser: argparse.ArgumentParser, bench: Path) -> list[str]:
    """Prepare setting ``name``'s checkpoint (and truths), run or read its jobs, and return its report lines."""
    s = SETTINGS[name]
    work = bench / name
    store = args.store or (RESULTS / f"compare_policies_{name}_cache" if s.model in PRETRAINED else work)
    work.mkdir(parents=True, exist_ok=True)
    store.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt, measured = prepare(s, work, store, truths=not args.no_truths)
    release_memory()  # the pretraining's model and optimizer, before the workers start
    print(f"# [{name}] checkpoint after {s.pretrain_steps} high-precision steps ({time.perf_counter() - t0:.0f} s; "
          f"fingerprint {measured['fingerprint']}); truth ceilings (split-half Spearman) "
          + (", ".join(f"{k} {v:.2f}" for k, v in measured["ceilings"].items()) if "ceilings" in measured
             else "not measured yet"), flush=True)

    def truths():
        _measure_truths(s, ckpt, measured, store)

    if s.accelerator == "gpu" and "truths" not in measured and not args.cached_only:
        truths()  # a GPU measures them in seconds: first, so that a cut-off run has whole seeds
    jobs = _jobs(args, s, parser)
    rows = run_jobs(s, ckpt, measured, jobs, store, args.workers, work, truths, args.cached_only)
    if args.cached_only:
        rows = complete_seeds(rows, jobs)
    lines = _setting_lines(name, s, rows, measured, t0, args)
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.objective_study:
        data = json.loads(args.objective_study.read_text())
        print("\n".join(objective_study(data["rows"], data["measured"])))
        return
    if args.structure_study:
        data = json.loads(args.structure_study.read_text())
        print("\n".join(structure_study(data["rows"], Setup(**data["setting"]))))
        return
    bench = Path(os.environ.get("SNIP_BENCH_DIR", os.path.join(tempfile.gettempdir(), "snip_compare_v2")))
    date = datetime.date.today().isoformat()
    command = "python benchmarks/compare_policies.py " + " ".join(sys.argv[1:])
    machine = f"{platform.machine()} ({os.cpu_count()} cores), Python {platform.python_version()}; FP4 emulated"
    start = time.perf_counter()
    names = args.search or [quick_setting(args.setting) if args.quick else args.setting]
    report = [f"# compare_policies v2 {'setting search ' if args.search else ''}— {date}",
              f"command: `{command.strip()}`; {args.seeds} seeds; machine: {machine}", ""]
    for name in names:
        report += run_setting(name, args, parser, bench)
    report.append(f"total {(time.perf_counter() - start) / 60:.1f} min")
    if args.quick:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    # A --policies study is named by its policies: two studies of a day do not overwrite each other.
    suffix = f"study_{'-'.join(args.policies)}_" if args.policies else "search_" if args.search else ""
    prefix = results_prefix(names[0]) if len(names) == 1 else "compare_policies_v2"
    (args.out / f"{prefix}_{suffix}{date}.md").write_text("\n".join(report) + "\n")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in FRACTION_POLICIES:
        xs = [float(f) for f in summary if name in summary[f]]
        ax.errorbar(xs, [summary[f"{x:g}"][name]["mean"] for x in xs], yerr=[summary[f"{x:g}"][name]["std"] for x in xs],
                    marker="o", capsize=3, label=name, ls="--" if name.endswith("_gemm") else "-")
    for frac, policies in summary.items():
        for name in ("all_fp8", "all_fp4") + NATURAL:
            if name in policies:
                ax.errorbar([float(frac)], [policies[name]["mean"]], yerr=[policies[name]["std"]], marker="s", label=name)
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.set_xlabel("FP4 FLOPs fraction")
    ax.set_ylabel("eval loss gap to bf16")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
