"""The tiny Llama the vLLM tests serve, made at test time: seeded random weights, a tokenizer
trained here, ``save_pretrained`` into a directory (no download)."""

from __future__ import annotations

import os
from pathlib import Path

#: the model's shape: head size 32 (the CPU backend's smallest), GQA 4 query heads over 2 KV heads
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 32
VOCAB = 384

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a paged kv cache moves between prefill and decode nodes",
    "every write carries immediate data and the decoder counts them",
    "one two three four five six seven eight nine ten eleven twelve",
    "disaggregated serving splits the prompt from the generation",
    "libfabric runs on tcp shared memory verbs and efa",
]


def make_model(path: Path, seed: int = 0, layers: int = LAYERS, kv_heads: int = KV_HEADS,
               heads: int = HEADS, head_dim: int = HEAD_DIM) -> Path:
    """Write the model and its tokenizer into ``path`` (once; returns ``path``); the shape
    arguments make the benchmark's larger model (tests/vllm/_bench.py)."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():                      # larger weights than the init: logits that differ
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    os.sync()
    return path
