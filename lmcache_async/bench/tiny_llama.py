"""Build a small random-weight Llama with transformers and save it as a model directory.

The directory is what vLLM loads (``config.json`` + safetensors); nothing is downloaded.
The weights are drawn from a fixed seed, so two builds with the same arguments are
byte-identical. The vLLM benchmarks build one when they are given no model. Usable as a
module (:func:`build_tiny_llama`) or as a script::

    python -m lmcache_async.bench.tiny_llama OUT_DIR [--layers 2] [--hidden 256] ...

transformers (a dependency of vLLM) is imported only when a model is built.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["TinyLlamaSpec", "build_tiny_llama", "main"]


@dataclass(frozen=True, slots=True)
class TinyLlamaSpec:
    """Shape of the model. ``head_dim`` must be one vLLM's CPU attention accepts (32, 64…)."""

    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 1024
    max_positions: int = 4096
    dtype: str = "float32"
    seed: int = 0


def build_tiny_llama(out_dir: str, spec: TinyLlamaSpec | None = None) -> str:
    """Create the model in ``out_dir`` (made if missing) and return the directory.

    Raises:
        ValueError: ``spec.dtype`` is not a torch floating dtype name.
    """
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415  (vLLM's extra)

    spec = spec or TinyLlamaSpec()
    dtype = getattr(torch, spec.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a torch floating dtype name, got {spec.dtype!r}")
    config = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(spec.seed)
    model_class: Any = LlamaForCausalLM  # transformers' stubs type .to() as a wrapper
    model = model_class(config).to(dtype)
    # A larger init spread than the default keeps the random model's logits far from ties,
    # so greedy decoding is stable across runs.
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.05)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "tiny_llama_spec.json"), "w", encoding="utf-8") as f:
        json.dump(asdict(spec), f)
    return out_dir


def main(argv: list[str]) -> int:
    """Build the model the command line describes (``OUT_DIR`` and spec flags)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    defaults = TinyLlamaSpec()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    out_dir = args.pop("out_dir")
    build_tiny_llama(out_dir, TinyLlamaSpec(**args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
