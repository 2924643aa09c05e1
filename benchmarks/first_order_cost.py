"""Cost of LD's first-order sampling (SNIPCallback, snip.first_order_steps / first_order_rows) on the demo
model: one training step with and without the FirstOrderSampler hooks, side by side in one process,
with the switched layers in bf16 (what a step costs on hardware with native low-precision kernels)
and in emulated mxfp4 (what it costs on this CPU). Candidates fp8 and mxfp4, LM head pinned (not
sampled), 256 sampled rows, batch 16x128, best of 2 x 4 steps each, seed 0.

    python benchmarks/first_order_cost.py
"""
import time

import torch
from lightning_snip.convert import convert_linears
from lightning_snip.demo.model import LlamaConfig, TinyLlama
from lightning_snip.divergence import FirstOrderTerms
from lightning_snip.formats import Format
from lightning_snip.stats import FirstOrderSampler
torch.set_num_threads(1); torch.manual_seed(0)
model = TinyLlama(LlamaConfig()); layers = convert_linears(model, pins={"*lm_head": "bf16"})
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
tok = torch.randint(256, (16, 129)); batch = (tok[:, :-1], tok[:, 1:])
terms = FirstOrderTerms([Format.FP8, Format.MXFP4])
sampler = FirstOrderSampler({f: l for f, l in layers.items() if l.pinned is None}, 256, terms.add)
def step(sample):
    if sample:
        with sampler.recording(offset=1):
            l = model.loss(batch); opt.zero_grad(); l.backward()
    else:
        l = model.loss(batch); opt.zero_grad(); l.backward()
    opt.step(); terms.take()
for fmt in (Format.BF16, Format.MXFP4):
    for l in layers.values():
        if l.pinned is None: l.format = fmt
    res = {}
    for sample in (False, True, False, True):
        step(sample)
        t = time.perf_counter()
        for _ in range(4): step(sample)
        res.setdefault(sample, []).append((time.perf_counter() - t) / 4)
    plain, sampled = min(res[False]), min(res[True])
    print(f"step in {fmt.value}: {plain*1000:.0f} ms, with first-order sampling {sampled*1000:.0f} ms: +{(sampled/plain-1)*100:.0f}% per sampled step; "
          f"32 of every 100 steps sampled: +{(sampled-plain)*32/(plain*100)*100:.1f}% wall time")
