"""Writes a tiny random LoRA adapter (PEFT's file format, no peft needed) for the tiny model of make_model.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# The tiny Llama's shapes (make_model.py): hidden 128, 2 heads × head_dim 64, 1 KV head, 2 layers.
HIDDEN = 128
LAYERS = 2
PROJECTIONS = {"q_proj": (HIDDEN, 2 * 64), "v_proj": (HIDDEN, 1 * 64)}
"""Target module -> (in features, out features)."""


def make_lora(path: Path, base: str, rank: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for name, (fan_in, fan_out) in PROJECTIONS.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            # Both factors non-zero (PEFT starts B at zero): the adapter changes the output, so a
            # request under it is a different computation from the base model's.
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank) * 0.5
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(PROJECTIONS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="directory to write the adapter into")
    parser.add_argument("--base", default="tiny", help="the base model's name (adapter_config.json)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=99)
    args = parser.parse_args()
    make_lora(args.out, args.base, args.rank, args.seed)
    print(f"tiny LoRA adapter written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
