"""Request schemas of the OpenAI / vLLM-compatible endpoints, and their mapping onto `SamplingParams`
(bodies are parsed by limits.json_object).

Fields follow OpenAI's completions and chat APIs plus the vLLM extras that RL clients send (`top_k`,
`min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`, `return_token_ids`,
`return_tokens_as_token_ids`). Unknown fields are refused (a typo must not silently change a
rollout's law); options with a neutral value (`min_p` 0, `repetition_penalty` 1, penalties 0) are
accepted at that value only, since the engine samples exactly the target's law and nothing else.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from rollout_ssd.params import SamplingParams


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400, or `status`: 429 when the queue is full); `param` names the
    offending field; `headers` go with the response (Retry-After)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400, headers: Optional[dict] = None):
        super().__init__(message)
        self.param, self.status, self.headers = param, status, headers


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _SamplingFields(_Strict):
    model: Optional[str] = None
    n: StrictInt = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False
    user: Optional[str] = None
    request_id: Optional[str] = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = None  # the server's --default-max-tokens, cut to the context
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates may read name, tool_calls, tool_call_id, ...
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none"], str, dict[str, Any]]] = None


def _neutral(req: _SamplingFields) -> None:
    """Refuse options whose non-neutral value would change the law the engine samples."""
    if req.min_p not in (None, 0, 0.0):
        raise BadRequest("min_p is not supported (only 0); the engine samples the target's law with "
                         "temperature, top_p and top_k", "min_p")
    if req.repetition_penalty not in (None, 1, 1.0):
        raise BadRequest("repetition_penalty is not supported (only 1)", "repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise BadRequest(f"{name} is not supported (only 0)", name)


def sampling_params(req: _SamplingFields, max_tokens: Optional[int], default_max_tokens: int,
                    default_seed: int) -> SamplingParams:
    """The engine's SamplingParams for a request; BadRequest naming the field for anything refused."""
    _neutral(req)
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    top_k = req.top_k
    if top_k is not None and top_k < -1:
        raise BadRequest(f"top_k must be -1, 0 (off) or a positive integer, got {top_k}", "top_k")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    values = {
        "n": req.n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if top_k in (None, -1) else top_k,
        "max_new_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "seed": default_seed if req.seed is None else req.seed,
        "stop_token_ids": tuple(req.stop_token_ids) if req.stop_token_ids else None,
        "ignore_eos": req.ignore_eos,
        "stop": tuple(stop) if stop else None,
    }
    try:
        return SamplingParams(**values)
    except ValueError as err:  # SamplingParams names its field; map it to the request's name
        field = str(err).split(" ", 1)[0].removeprefix("SamplingParams.")
        param = {"max_new_tokens": "max_tokens"}.get(field, field)
        raise BadRequest(str(err).replace("SamplingParams.max_new_tokens", "max_tokens"), param) from None


def completion_prompts(prompt) -> list:
    """OpenAI's prompt forms as a list of prompts: a string, strings, one token-id list, token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def check_completion(req: CompletionRequest) -> None:
    if req.logprobs is not None and req.logprobs != 0:
        raise BadRequest("logprobs > 0 (top alternatives) is not supported; use 0 for the sampled token's "
                         "logprob", "logprobs")
    if req.echo:
        raise BadRequest("echo is not supported", "echo")
    if req.best_of is not None and req.best_of != req.n:
        raise BadRequest("best_of is not supported (only equal to n)", "best_of")
    if req.suffix is not None:
        raise BadRequest("suffix is not supported", "suffix")


def check_chat(req: ChatRequest) -> None:
    if req.top_logprobs not in (None, 0):
        raise BadRequest("top_logprobs > 0 is not supported; use logprobs=true with top_logprobs 0", "top_logprobs")
    if req.tools and req.tool_choice not in (None, "none"):
        raise BadRequest("tool calling is not supported: tools are rendered by the chat template, but only "
                         "tool_choice='none' is honoured", "tool_choice")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
