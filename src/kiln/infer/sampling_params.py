"""SamplingParams: how one request turns logits into tokens, and when it stops; validated on construction.

The fields and their meaning follow vLLM's (and through it OpenAI's and HF's), so a server request maps onto
them field by field:
  temperature        0 = greedy (argmax of the penalized logits); > 0 divides the logits
  top_k              keep the k largest logits (ties with the k-th kept); -1 = off (0 is accepted as off)
  top_p              keep the smallest set of most likely tokens whose mass reaches top_p; 1 = off
  min_p              drop tokens whose probability is below min_p * the largest probability; 0 = off
  repetition_penalty HF's: a logit l of a token seen in the prompt or the output becomes l / p if l > 0
                     else l * p; 1 = off
  frequency_penalty, presence_penalty   OpenAI's: l -= frequency * count_in_output
                     + presence * (count_in_output > 0); 0 = off; both in [-2, 2]
  seed               per-request randomness; None = the engine draws one at arrival (Sequence.seed holds
                     the effective one), so a request is reproducible from its seed alone
  stop               stop strings, matched by the engine on the detokenized text (carried here only)
  stop_token_ids     token ids that finish the request (finish_reason "stop")
  ignore_eos         keep generating past the model's EOS token(s)
  max_tokens         output tokens at most (finish_reason "length")
  logprobs           None = none; k >= 0: the sampled token's logprob plus the k most likely (id, logprob)
  prompt_logprobs    the same for every prompt token (the first has none)
  n                  completions per prompt (the engine expands a request into n sequences)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiln.errors import KilnError

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("n", self.n, minimum=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise KilnError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check_int("top_k", self.top_k, minimum=None)
        if self.top_k == 0:
            self.top_k = -1  # 0 is a common spelling of "off" (HF, OpenAI clients); one spelling inside
        if self.top_k < -1:
            raise KilnError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise KilnError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise KilnError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise KilnError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise KilnError(f"{name} must be in [-2, 2] (OpenAI's range; 0 = off), got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(1 << 63))
            if self.seed >= 1 << 64:
                raise KilnError(f"seed must fit in 64 bits ([-2**63, 2**64)), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise KilnError(f"{name} must be None or in [0, {MAX_LOGPROBS}], got {value}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) for s in self.stop):
            raise KilnError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if any(s == "" for s in self.stop):
            raise KilnError("stop strings must be non-empty (an empty string would stop at once)")
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise KilnError(
                f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise KilnError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value: object, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise KilnError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise KilnError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise KilnError(f"{name} must be a finite number, got {value!r}")
