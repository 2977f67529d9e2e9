"""The tiny test models the end-to-end demo and tests serve, with random weights and a byte-level BPE tokenizer,
both built locally (nothing is downloaded) and written once into a cache folder: a Llama (GQA) and a
DeepSeek-V2-shaped MLA model (`MODELS`).

Owns `TinyModelSpec` (the model's shape), `MODELS` (the specs by name) and `build_tiny_model(spec, cache_dir) ->
Path`, which writes a folder
that `vllm serve` and transformers load like any Hugging Face checkpoint. The folder name carries a digest of the
spec, so a changed spec builds a new folder and a finished one is reused; the build writes into a temporary
folder and renames it, so an interrupted build never leaves a half-written model behind.

Called by the vLLM demo (kvstage.demo.vllm) and the end-to-end tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: Text the tokenizer is trained on and the demo's prompts are drawn from: plain ASCII so every byte is covered.
CORPUS: tuple[str, ...] = (
    "The staging ring hands the KV cache from prefill to decode in one bulk write per writer.",
    "Decode registers the room before prefill announces it; every room ends by its deadline.",
    "A watermark tells writers which part of the ring they may overwrite, and it never goes back.",
    "Prefill TP two feeds decode TP one: each decode rank scatters the heads it holds.",
    "Lost, duplicated and reordered messages never leak ring space or stall a request.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"()[]{}<>/\\|-_+=*&^%$#@~`",
)


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of a tiny model: a Llama, or with `kv_lora_rank` set a DeepSeek-V2 (MLA, dense MLP in every layer).
    float32 by default, so greedy tokens do not depend on the TP reduction order. vLLM's CPU MLA kernel needs a
    latent of 576 elements (`kv_lora_rank` 512 + `qk_rope_head_dim` 64)."""

    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    seed: int = 20261201
    kv_lora_rank: int = 0  # MLA's latent width without the rope part; 0: a Llama
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def head_dim(self) -> int:
        """The width of one KV head vLLM caches: the latent row for MLA."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.mla else self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """KV heads kvstage moves: MLA's latent is one head, the same on every TP rank."""
        return 1 if self.mla else self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's cached KV over all layers (float32)."""
        per_head = self.head_dim if self.mla else 2 * self.head_dim
        return self.num_layers * self.kv_heads * per_head * 4

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


#: The tiny models by name (`kvstage demo --model`).
MODELS: dict[str, TinyModelSpec] = {
    "llama-tiny": TinyModelSpec(),
    "deepseek-tiny": TinyModelSpec(num_kv_heads=4, kv_lora_rank=512),
}


def default_cache_dir() -> Path:
    """`$KVSTAGE_CACHE` or `$XDG_CACHE_HOME/kvstage` (`~/.cache/kvstage`)."""
    if explicit := os.environ.get("KVSTAGE_CACHE"):
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvstage"


def build_tiny_model(spec: TinyModelSpec = TinyModelSpec(), cache_dir: Path | None = None) -> Path:
    """The folder of the tiny model for `spec`, built on first use (a few seconds) and reused afterwards."""
    root = (cache_dir or default_cache_dir()) / "models"
    target = root / f"tiny-{'deepseek-v2' if spec.mla else 'llama'}-{spec.digest()}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        _write_tokenizer(spec, scratch)
        _write_model(spec, scratch)
        scratch.rename(target)
    except FileExistsError:  # another process finished the same build first; theirs is identical
        shutil.rmtree(scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return target


def _write_tokenizer(spec: TinyModelSpec, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(folder)


def _write_model(spec: TinyModelSpec, folder: Path) -> None:
    import torch
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedModel,
    )

    common: dict[str, Any] = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "dtype": spec.dtype,
    }
    torch.manual_seed(spec.seed)
    if spec.mla:
        mla = DeepseekV2Config(
            **common,
            kv_lora_rank=spec.kv_lora_rank,
            q_lora_rank=None,
            qk_rope_head_dim=spec.qk_rope_head_dim,
            qk_nope_head_dim=spec.qk_nope_head_dim,
            v_head_dim=spec.v_head_dim,
            first_k_dense_replace=spec.num_layers,  # a dense MLP in every layer: no experts to route
        )
        model: PreTrainedModel = DeepseekV2ForCausalLM(mla)  # type: ignore[no-untyped-call]
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))  # type: ignore[no-untyped-call]
    model = model.to(getattr(torch, spec.dtype))
    # Random weights at the default init give near-uniform logits; a wider spread gives greedy decoding clear
    # winners, so a token mismatch means a real difference in the KV, not a tie broken by rounding.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder, safe_serialization=True)
