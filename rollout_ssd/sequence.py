"""A sequence being generated: its tokens, logprobs, generator and stopping rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from rollout_ssd.params import SamplingParams


@dataclass
class Sequence:
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    stop_ids: frozenset[int]
    max_total_len: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    slot: int = -1
    versions: set = field(default_factory=set)  # weight versions its tokens were verified under
    request_id: int = -1  # the scheduler's Request this sequence belongs to
    # stop strings: stop_text(token_ids) -> the stop string the text now ends with, or None
    stop_text: Optional[Callable[[list[int]], Optional[str]]] = None
    stop_string: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1] if self.token_ids else self.prompt_token_ids[-1]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.token_ids

    @property
    def budget(self) -> int:
        """How many more tokens this sequence may emit."""
        return min(self.params.max_new_tokens - len(self.token_ids), self.max_total_len - self.num_tokens)

    def append(self, tokens: list[int], logprobs: list[float]) -> int:
        """Append emitted tokens up to the first stop token or the length budget; the rest of a
        speculative run past a stop is dropped, exactly as AR would never have produced it.
        Returns how many were kept."""
        kept = 0
        for tok, lp in zip(tokens, logprobs):
            if self.finished:
                break
            self.token_ids.append(int(tok))
            self.logprobs.append(float(lp))
            kept += 1
            if int(tok) in self.stop_ids:
                self.finish_reason = "stop"
            elif self.stop_text is not None and (hit := self.stop_text(self.token_ids)) is not None:
                self.finish_reason, self.stop_string = "stop", hit
            elif self.budget <= 0:
                self.finish_reason = "length"
        return kept
