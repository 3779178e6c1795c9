"""The engine's edges: prompts in, text out. Everything between them is token ids.

`Edges` turns a call's prompts (text, or token-id lists) into checked token ids and then into
`Sequence`s (stop tokens, stop strings, per-sequence generator, context limit), and finished sequences
back into `Rollout`s (text decoded, cut before a stop string as vLLM does). The scheduler and the
decode strategies never see text; this is the only module that touches the tokenizer.
"""

from __future__ import annotations

import numbers
from typing import Callable, Optional
from typing import Sequence as Seq

from rollout_ssd.models.loader import LoadedModel
from rollout_ssd.params import Prompt, Rollout, SamplingParams
from rollout_ssd.sampling import sequence_generator
from rollout_ssd.sequence import Sequence


class Edges:
    """Tokenization and rollout building for one target model and context length."""

    def __init__(self, target: LoadedModel, max_model_len: int):
        self.target = target
        self.max_model_len = max_model_len

    @property
    def tokenizer(self):
        return self.target.tokenizer

    # ------------------------------------------------------------------ prompts in
    def sequences(self, prompts: Seq[Prompt], params: SamplingParams,
                  prompt_indices: Optional[Seq[int]] = None) -> list[Sequence]:
        """len(prompts) * params.n new sequences, ordered by (prompt, sample); sample j of the prompt
        with global index i gets the generator of (seed, i, j). ValueError names the bad input."""
        prompt_ids = self.tokenize(prompts, params)
        indices = self._indices(prompt_indices, len(prompt_ids))
        return [self._new_sequence(i, j, ids, params) for i, ids in zip(indices, prompt_ids) for j in range(params.n)]

    @staticmethod
    def _indices(prompt_indices: Optional[Seq[int]], count: int) -> list[int]:
        if prompt_indices is None:
            return list(range(count))
        indices = list(prompt_indices)
        if len(indices) != count:
            raise ValueError(f"prompt_indices has {len(indices)} entries for {count} prompts")
        if any(not isinstance(i, numbers.Integral) or isinstance(i, bool) or i < 0 for i in indices):
            raise ValueError("prompt_indices must be non-negative integers")
        if len(set(indices)) != len(indices):
            raise ValueError("prompt_indices must be distinct")
        return [int(i) for i in indices]

    def tokenize(self, prompts: Seq[Prompt], params: SamplingParams) -> list[list[int]]:
        """Token ids of every prompt (chat template applied if params.chat); ValueError names the bad
        prompt's index."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Seq):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        out = []
        for i, p in enumerate(prompts):
            ids = self._text_ids(i, p, params) if isinstance(p, str) else self._given_ids(i, p, params)
            if not ids:
                raise ValueError(f"prompts[{i}] is empty")
            vocab = self.target.model.cfg.vocab_size
            if not all(0 <= t < vocab for t in ids):
                raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab})")
            if len(ids) >= self.max_model_len:
                raise ValueError(f"prompts[{i}] has {len(ids)} tokens; the context holds {self.max_model_len} "
                                 f"(prompt plus at least one generated token)")
            out.append(ids)
        return out

    def _text_ids(self, i: int, text: str, params: SamplingParams) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise ValueError(f"prompts[{i}] is text but the model has no tokenizer; pass token ids")
        if not text:
            raise ValueError(f"prompts[{i}] is empty")
        if not params.chat:
            return tok(text).input_ids
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    @staticmethod
    def _given_ids(i: int, p, params: SamplingParams) -> list[int]:
        if not isinstance(p, Seq):
            raise ValueError(f"prompts[{i}] must be a string or a list of token ids, got {type(p).__name__}")
        if params.chat:
            raise ValueError(f"prompts[{i}]: chat=True needs text prompts, got token ids")
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) for t in p):
            raise ValueError(f"prompts[{i}] must hold integer token ids")
        return [int(t) for t in p]

    def _new_sequence(self, i: int, j: int, ids: list[int], params: SamplingParams) -> Sequence:
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop |= set(self.target.model.cfg.eos_token_ids)
        return Sequence(prompt_index=i, sample_index=j, prompt_token_ids=ids, params=params,
                        generator=sequence_generator(params.seed, i, j), stop_ids=frozenset(stop),
                        max_total_len=self.max_model_len, stop_text=self._stop_text(params.stop))

    def _stop_text(self, stops: Optional[tuple[str, ...]]) -> Optional[Callable[[list[int]], Optional[str]]]:
        """A check for stop strings: decodes the last few tokens (enough to hold the longest stop string's
        bytes, since a string that just completed ends inside them) and names the stop string found."""
        if not stops:
            return None
        tok = self.tokenizer
        if tok is None:
            raise ValueError("SamplingParams.stop needs a tokenizer; this model has none (use stop_token_ids)")
        window = max(len(x.encode("utf-8")) for x in stops) + 8  # every token decodes to >= 1 byte

        def check(token_ids: list[int]) -> Optional[str]:
            text = tok.decode(token_ids[-window:], skip_special_tokens=True)
            hits = [(text.find(x), x) for x in stops if x in text]
            return min(hits)[1] if hits else None

        return check

    # ------------------------------------------------------------------ text out
    def rollouts(self, seqs: list[Sequence], weight_version: int) -> list[Rollout]:
        """One Rollout per sequence; weight_version: the version served now (for a sequence that never
        ran a round)."""
        return [
            Rollout(
                prompt_index=s.prompt_index, sample_index=s.sample_index, prompt_token_ids=s.prompt_token_ids,
                token_ids=s.token_ids, logprobs=s.logprobs, text=self._text(s),
                finish_reason=s.finish_reason, weight_version=max(s.versions, default=weight_version),
                extra=self._extra(s),
            )
            for s in seqs
        ]

    @staticmethod
    def _extra(seq: Sequence) -> dict:
        extra = {}
        if len(seq.versions) > 1:
            extra["weight_versions"] = sorted(seq.versions)
        if seq.stop_string is not None:
            extra["stop_string"] = seq.stop_string
        return extra

    def _text(self, seq: Sequence) -> Optional[str]:
        """The rollout's text; with a stop string, the text before its first occurrence (as vLLM)."""
        tok = self.tokenizer
        if tok is None:
            return None
        text = tok.decode(seq.token_ids, skip_special_tokens=True)
        cut = text.find(seq.stop_string) if seq.stop_string is not None else -1
        return text if cut < 0 else text[:cut]
