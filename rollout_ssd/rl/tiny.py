"""The recipes' `--tiny` preset: a seeded random target/draft pair small enough to train in seconds.

Both are real HF checkpoint directories (config.json + model.safetensors + a tokenizer), so the tiny
run goes through exactly the code the default model does: our loaders, the engine, SSD's draft worker,
weight sync. The tokenizer is character level (one token per character of `tasks.ALPHABET`, plus
<pad>, <unk>, <eos>), built with the `tokenizers` library, so prompts are text and rewards read text.
The draft is a noisy copy of the target (it agrees often but not always, so SSD sees hits and misses).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock

from rollout_ssd.config import require_positive_ints

SPECIALS = ("<pad>", "<unk>", "<eos>")


@dataclass(frozen=True)
class TinyConfig:
    """hidden / layers / heads of the tiny Llama; draft_noise: relative noise of the draft copy."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 256
    draft_noise: float = 0.2
    seed: int = 0

    def __post_init__(self):
        require_positive_ints(self, ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                                     "max_position_embeddings"))
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("TinyConfig: hidden_size must divide by num_heads, num_heads by num_kv_heads")
        if self.draft_noise < 0:
            raise ValueError(f"TinyConfig.draft_noise must be >= 0, got {self.draft_noise}")


def char_tokenizer(alphabet: str):
    """A transformers fast tokenizer with one token per character of `alphabet` (ids after SPECIALS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet):
        raise ValueError("char_tokenizer: the alphabet has repeated characters")
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def build_tiny_pair(directory: str | Path, alphabet: str, config: TinyConfig = TinyConfig()) -> tuple[Path, Path]:
    """Write `directory/target` and `directory/draft` (skipped when both exist with the same recipe, so
    actors and reruns share them). Returns their paths.

    Rollout actors call this concurrently: the check and the build run under a file lock, and the
    recipe stamp is removed before a rebuild and written last, so no caller returns while another is
    still writing the files it is about to read."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target_dir, draft_dir = directory / "target", directory / "draft"
    recipe = {"alphabet": alphabet, **config.__dict__}
    stamp = directory / "tiny_recipe.json"
    with FileLock(str(directory / ".build.lock")):
        if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
            return target_dir, draft_dir
        stamp.unlink(missing_ok=True)
        _write_tiny_pair(target_dir, draft_dir, alphabet, config)
        stamp.write_text(json.dumps(recipe))
    return target_dir, draft_dir


def _write_tiny_pair(target_dir: Path, draft_dir: Path, alphabet: str, config: TinyConfig) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer(alphabet)
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    hf_cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=config.hidden_size,
                         intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                         num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                         max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(config.seed)
        model = LlamaForCausalLM(hf_cfg).float().eval()
        model.save_pretrained(target_dir, safe_serialization=True)
        tokenizer.save_pretrained(target_dir)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(config.draft_noise * p.std() * torch.randn_like(p))
        model.save_pretrained(draft_dir, safe_serialization=True)
    finally:
        torch.random.set_rng_state(gen_state)
