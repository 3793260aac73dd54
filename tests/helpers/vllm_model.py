"""A tiny Llama made here, for vLLM tests: no hub, no download.

The weights are a pure function of a seed (`state_dict(seed)`, plain torch), so the test
process that publishes version ``v`` and a vLLM process that loads "the same weights from
disk" agree bit for bit without passing tensors around. `write_model(path, seed)` writes a
complete HF checkpoint (config, a BPE tokenizer trained here on a few lines, one
safetensors file); it needs transformers, tokenizers and safetensors, which only the vLLM
venv has (see `vllm_env`), so run it there: ``python -m tests.helpers.vllm_model DIR SEED``.

Sizes: hidden 256, 2 layers, 4 heads of 64 (vLLM's CPU attention wants a supported head
size: 64 works, 16 does not), 2 KV heads (so qkv_proj really fuses three different
shapes), vocab 512, bf16. `config(hidden=..., layers=...)` makes a larger one for the
benchmark.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

TINY: dict[str, int] = {
    "hidden": 256,
    "intermediate": 512,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 512,
}

# The lines the tokenizer is trained on; prompts in tests use words from them.
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "weights move from a trainer to the workers through shared memory",
    "an inference engine generates rollouts for a training loop",
    "every version of the model is published atomically",
    "once upon a time there was a small language model",
    "zero copy buffers and small control messages",
]


def config(**sizes: int) -> dict[str, Any]:
    """The HF config.json of a Llama of these sizes (TINY's where not given)."""
    s = {**TINY, **sizes}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["hidden"] // s["heads"],
        "vocab_size": s["vocab"],
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


def shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape, in the order HF writes them."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })  # fmt: skip
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    return out


def state_dict(seed: int, cfg: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Version `seed` of the weights: bf16, the same bits in every process (CPU torch).

    Scaled so that different seeds give different greedy tokens: norms near 1, matrices
    with std 1/sqrt(fan_in) (a std of 0.02 would make every seed say the same thing).
    """
    cfg = cfg or config()
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes(cfg).items():
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        out[name] = t.to(torch.bfloat16)
    return out


def write_tokenizer(path: Path, vocab: int) -> None:
    """A byte-level BPE trained on `CORPUS` (tokenizers), saved for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(path))


def write_model(path: Path, seed: int, **sizes: int) -> Path:
    """A complete checkpoint directory for vLLM: config, tokenizer, weights of `seed`."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = config(**sizes)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(path, cfg["vocab_size"])
    save_weights(path, state_dict(seed, cfg))
    return path


def save_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    """Replace the checkpoint's weights (one safetensors file)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))


if __name__ == "__main__":
    target, seed_arg, *rest = sys.argv[1:]
    extra = {k: int(v) for k, v in (a.split("=", 1) for a in rest)}
    write_model(Path(target), int(seed_arg), **extra)
