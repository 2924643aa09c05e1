"""Does SNIPCallback's default configuration set up on a model whose pinned LM head is most of its FLOPs? (issue 53)

Gemma-3-270M's shapes (18 blocks of width 640, a 262,144-token vocabulary: the LM head is 62.6% of the linear
FLOPs), built on the meta device from transformers' Gemma3 classes (no weights: setup reads shapes only).
SNIPConfig() with target_scope=model (the meaning of fp4_fraction until 2026-12-04) against the default
(switchable): the setup's error or its target line.

    python benchmarks/target_scope_setup.py
"""

from __future__ import annotations

import logging

import torch


def main() -> None:
    import transformers

    from lightning_snip.config import SNIPConfig
    from lightning_snip.controller import SNIPController
    from lightning_snip.evidence import describe_target

    logging.getLogger("lightning_snip").setLevel(logging.WARNING)
    config = transformers.Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                                           num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                                           head_dim=256)
    with torch.device("meta"):
        model = transformers.Gemma3ForCausalLM(config)
    print("| SNIPConfig | setup |\n|---|---|")
    for kw in ({"target_scope": "model"}, {}):
        controller = SNIPController(SNIPConfig(**kw))
        try:
            controller.attach(model, device="cpu")
            outcome = f"passes; target {describe_target(controller.layers, controller.config)}"
        except ValueError as err:
            outcome = f"fails: `{err}`"
        print(f"| `SNIPConfig({', '.join(f'{k}={v!r}' for k, v in kw.items())})` | {outcome} |")


if __name__ == "__main__":
    main()
