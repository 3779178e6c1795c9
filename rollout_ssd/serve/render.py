"""Response bodies of the OpenAI / vLLM-compatible endpoints, built from rollouts.

Choices come out prompt-major (the n samples of prompt 0, then prompt 1, ...), as vLLM returns them.
Logprobs are the engine's (docs/DESIGN.md): log softmax(logits / T) over the full vocabulary, before
top-k / top-p truncation; they equal vLLM's `processed_logprobs` when top_k and top_p are off.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from rollout_ssd.params import Rollout


def _versions(r: Rollout) -> dict:
    """`weight_versions`: every version a choice's tokens were sampled under, when there were several (an
    update landed while it ran); weight_version is then the latest."""
    return {"weight_versions": r.extra["weight_versions"]} if "weight_versions" in r.extra else {}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Renderer:
    """Token strings and text for one served model (tokenizer may be None: token-id prompts only)."""

    def __init__(self, tokenizer, model_name: str, eos_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.model = model_name
        self.eos_ids = frozenset(eos_ids)

    def piece(self, token_id: int, as_ids: bool) -> str:
        if as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def stop_reason(self, r: Rollout):
        """vLLM's stop_reason: the stop string or stop token id that ended it; None for EOS or length."""
        if r.finish_reason != "stop":
            return None
        if "stop_string" in r.extra:
            return r.extra["stop_string"]
        last = r.token_ids[-1] if r.token_ids else None
        return None if last in self.eos_ids else last

    def completion_logprobs(self, token_ids: list[int], logprobs: list[float], as_ids: bool) -> dict:
        tokens = [self.piece(t, as_ids) for t in token_ids]
        return {"tokens": tokens, "token_logprobs": list(logprobs),
                "top_logprobs": [{p: lp} for p, lp in zip(tokens, logprobs)]}

    def chat_logprobs(self, token_ids: list[int], logprobs: list[float], as_ids: bool) -> dict:
        content = []
        for t, lp in zip(token_ids, logprobs):
            piece = self.piece(t, as_ids)
            content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")), "top_logprobs": []})
        return {"content": content}

    @staticmethod
    def _text_offsets(tokens: list[str]) -> list[int]:
        offsets, at = [], 0
        for piece in tokens:
            offsets.append(at)
            at += len(piece)
        return offsets

    @staticmethod
    def usage(rollouts: list[Rollout], n: int) -> dict:
        prompt = sum(len(r.prompt_token_ids) for r in rollouts[::n])
        completion = sum(len(r.token_ids) for r in rollouts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def completion(self, rollouts: list[Rollout], n: int, logprobs: Optional[int], return_ids: bool,
                   as_ids: bool) -> dict:
        choices = []
        for index, r in enumerate(rollouts):
            choice = {"index": index, "text": r.text or "", "finish_reason": r.finish_reason,
                      "stop_reason": self.stop_reason(r), "weight_version": r.weight_version, "logprobs": None,
                      **_versions(r)}
            if logprobs is not None:
                choice["logprobs"] = self.completion_logprobs(r.token_ids, r.logprobs, as_ids)
                choice["logprobs"]["text_offset"] = self._text_offsets(choice["logprobs"]["tokens"])
            if return_ids:
                choice["token_ids"] = list(r.token_ids)
                choice["prompt_token_ids"] = list(r.prompt_token_ids)
            choices.append(choice)
        return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": choices, "usage": self.usage(rollouts, n)}

    def chat(self, rollouts: list[Rollout], logprobs: bool, return_ids: bool, as_ids: bool) -> dict:
        choices = []
        for index, r in enumerate(rollouts):
            choice = {"index": index, "message": {"role": "assistant", "content": r.text or ""},
                      "finish_reason": r.finish_reason, "stop_reason": self.stop_reason(r),
                      "weight_version": r.weight_version, **_versions(r),
                      "logprobs": self.chat_logprobs(r.token_ids, r.logprobs, as_ids) if logprobs else None}
            if return_ids:
                choice["token_ids"] = list(r.token_ids)
            choices.append(choice)
        body = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
                "model": self.model, "choices": choices, "usage": self.usage(rollouts, len(rollouts))}
        if return_ids and rollouts:
            body["prompt_token_ids"] = list(rollouts[0].prompt_token_ids)
        return body


    def completion_chunk(self, cid: str, index: int, token_ids: list[int], logprobs: list[float], delta: str,
                         rollout: Optional[Rollout], *, with_logprobs: bool, return_ids: bool, as_ids: bool) -> dict:
        """One streamed choice of /v1/completions: the tokens and text new since the last chunk."""
        choice = {"index": index, "text": delta, "finish_reason": rollout.finish_reason if rollout else None,
                  "logprobs": self.completion_logprobs(token_ids, logprobs, as_ids) if with_logprobs else None}
        if return_ids:
            choice["token_ids"] = token_ids
            if rollout is not None:
                choice["prompt_token_ids"] = rollout.prompt_token_ids
        if rollout is not None:  # the last chunk of a choice: the version(s) its tokens were sampled under
            choice.update(weight_version=rollout.weight_version, **_versions(rollout))
        return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [choice]}

    def chat_chunk(self, cid: str, index: int, token_ids: list[int], logprobs: list[float], delta: str,
                   rollout: Optional[Rollout], *, with_logprobs: bool, return_ids: bool, as_ids: bool) -> dict:
        """One streamed choice of /v1/chat/completions (a `delta` message)."""
        choice = {"index": index, "delta": {"role": "assistant", "content": delta},
                  "finish_reason": rollout.finish_reason if rollout else None,
                  "logprobs": self.chat_logprobs(token_ids, logprobs, as_ids) if with_logprobs else None}
        if return_ids:
            choice["token_ids"] = token_ids
        if rollout is not None:
            choice.update(weight_version=rollout.weight_version, **_versions(rollout))
        return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model,
                "choices": [choice]}


class TextStream:
    """Incremental text of one sequence for streaming: sends only text that can no longer change (a
    trailing partial UTF-8 character, a stop string and what follows it, or a tail that may still grow
    into a stop string, is held back)."""

    def __init__(self, tokenizer, stops: Optional[tuple[str, ...]]):
        self.tokenizer = tokenizer
        self.stops = stops or ()
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.sent = 0
        self.tokens_sent = 0

    def delta(self, token_ids: list[int], final_text: Optional[str]) -> str:
        if self.tokenizer is None:
            return ""
        if final_text is not None:
            text = final_text
        else:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            text = text.rstrip("\ufffd")
            for stop in self.stops:  # a sequence that just ended may already hold its stop string
                cut = text.find(stop)
                text = text if cut < 0 else text[:cut]
            if self.stops:
                text = text[:max(self.sent, len(text) - self.hold)]
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out
