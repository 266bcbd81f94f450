"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, validated, and their mapping onto
SamplingParams; OpenAI's JSON error shape.

Types are strict (a string where a number belongs is a 400, not a silent conversion) and unknown fields are
refused (a field the server does not implement is an error naming it, not silently ignored); `user` is
accepted and unused, as OpenAI's own API does. Range checks on sampling values are SamplingParams' own
(one source of truth), so their messages name the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.errors import KilnError
from kiln.infer.sampling_params import SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        500: "internal_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share. top_k, min_p, repetition_penalty and ignore_eos are vLLM's
    extensions (the openai client sends them through `extra_body`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None):
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                frequency_penalty=self.frequency_penalty,
                presence_penalty=self.presence_penalty,
                seed=self.seed,
                stop=stop,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                n=self.n,
            )
        except KilnError as e:
            raise APIError(400, str(e)) from None


# a prompt: text, token ids, a list of texts, or a list of token-id lists (OpenAI's four forms)
Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0)] | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "the prompt is empty: give at least one token", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # text, or OpenAI's content parts of which only {"type": "text", "text": ...} is supported
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"only text content parts are supported, got {part.get('type')!r}",
                        param="messages",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        out = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(
                400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens"
            )
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable line from pydantic's errors: the first error, with its field path."""
    e = errors[0]
    loc = ".".join(str(x) for x in e.get("loc", ()))
    kind = e.get("type", "")
    if kind == "missing":
        return f"the field {loc!r} is required", loc
    if kind == "extra_forbidden":
        return f"unknown field {loc!r}: this server does not support it", loc
    return f"{loc}: {e.get('msg', 'invalid value')} (got {e.get('input')!r})", loc
