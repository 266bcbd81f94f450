"""OpenAI's response bodies from the engine's RequestOutputs: whole responses, streamed chunks (text
deltas), usage, and logprobs in the two shapes (legacy completions and chat differ).

A stream sends each completion's text as deltas of the engine's full text. Two things are held back until
more tokens (or the end) arrive, so the deltas add up to exactly the non-streamed text:
  - trailing U+FFFD: the decode of a multi-byte character cut between tokens (the next token completes it);
  - a tail that is the start of a stop string: the engine cuts the text where a stop string begins, and a
    delta already sent could not be taken back.
"""

from __future__ import annotations

import time

from kiln.infer.engine import CompletionOutput, RequestOutput


class TokenText:
    """Token id -> its text and bytes for logprobs (the tokenizer's; "token_id:N" without one, vLLM's form)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        if self.tokenizer is not None:
            try:
                return self.tokenizer.decode([token_id])
            except (ValueError, KeyError):  # an id of the model's padded vocabulary the tokenizer lacks
                pass
        return f"token_id:{token_id}"

    def bytes(self, token_id: int) -> list[int]:
        if self.tokenizer is not None and hasattr(self.tokenizer, "decode_bytes"):
            try:
                return list(self.tokenizer.decode_bytes([token_id]))
            except (ValueError, KeyError):
                pass
        return list(self.text(token_id).encode("utf-8"))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def stable_text(text: str, stops: list[str], finished: bool) -> str:
    """The part of `text` that can be sent now (module docstring)."""
    if finished:
        return text
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold]


class Choice:
    """One choice of a response (prompt i, completion j): what its stream has sent so far."""

    def __init__(self, index: int, echo: str = ""):
        self.index = index
        self.echo = echo  # the prompt text, sent before the completion (completions' `echo`)
        self.sent_chars = 0
        self.sent_tokens = 0
        self.started = False
        self.ended = False  # its finish_reason was sent (later outputs of the request repeat it)
        # legacy logprobs: the text_offset after the last token sent (offsets add up the tokens' own texts,
        # as the whole response's do, not the characters sent: held-back text would shift them)
        self.lp_offset = 0

    def delta(self, comp: CompletionOutput, stops: list[str], finished: bool) -> tuple[str, int, int]:
        """(new text, first new token, end token) since the last call."""
        text = stable_text(comp.text, stops, finished)
        new = text[self.sent_chars :] if len(text) > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, len(text))
        lo, hi = self.sent_tokens, len(comp.token_ids)
        self.sent_tokens = hi
        return new, lo, hi


class ResponseBuilder:
    """Builds one request's response objects; `chat` picks the chat shapes, else legacy completions."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        tokens: TokenText,
        n: int,
        stops: list[str],
        logprobs: int | None,
        echo: list[str] | None = None,
    ):
        self.id, self.model, self.chat, self.tokens = request_id, model, chat, tokens
        self.n, self.stops, self.k = n, stops, logprobs
        self.echo = echo  # per prompt, the prompt text to put before its completions
        self.created = int(time.time())
        self.choices: dict[int, Choice] = {}

    def _choice(self, prompt_index: int, comp: CompletionOutput) -> Choice:
        idx = prompt_index * self.n + comp.index
        if idx not in self.choices:
            self.choices[idx] = Choice(idx, self.echo[prompt_index] if self.echo else "")
        return self.choices[idx]

    # ---- logprobs --------------------------------------------------------------------------------------
    def _chat_logprobs(self, comp: CompletionOutput, lo: int, hi: int) -> dict | None:
        if self.k is None or comp.logprobs is None:
            return None
        t = self.tokens
        content = []
        for pos in range(lo, hi):
            tid = comp.token_ids[pos]
            tops = comp.top_logprobs[pos][: self.k] if comp.top_logprobs else []
            content.append(
                {
                    "token": t.text(tid),
                    "logprob": comp.logprobs[pos],
                    "bytes": t.bytes(tid),
                    "top_logprobs": [
                        {"token": t.text(i), "logprob": v, "bytes": t.bytes(i)} for i, v in tops
                    ],
                }
            )
        return {"content": content, "refusal": None}

    def _completion_logprobs(
        self, comp: CompletionOutput, lo: int, hi: int, offset: int, prompt: RequestOutput | None
    ) -> dict | None:
        """Legacy shape: tokens, token_logprobs, top_logprobs (the chosen token with the k most likely),
        text_offset. With echo (`prompt` given) the prompt's tokens come first: the first has no logprob,
        the others carry their own logprob only (the engine reports no top-k at prompt positions)."""
        if self.k is None or comp.logprobs is None:
            return None
        t = self.tokens
        tokens, lps, tops, offsets = [], [], [], []
        if prompt is not None:
            plp = prompt.prompt_logprobs or []
            for p, tid in enumerate(prompt.prompt_token_ids):
                s = t.text(tid)
                tokens.append(s)
                lps.append(plp[p - 1] if 0 < p <= len(plp) else None)
                tops.append({s: lps[-1]} if lps[-1] is not None else None)
                offsets.append(offset)
                offset += len(s)
        for pos in range(lo, hi):
            tid = comp.token_ids[pos]
            s = t.text(tid)
            # the chosen token first; tokens whose text repeats (byte pieces decode to U+FFFD) keep the first
            top = {s: comp.logprobs[pos]}
            for i, v in comp.top_logprobs[pos][: self.k] if comp.top_logprobs else []:
                top.setdefault(t.text(i), v)
            tokens.append(s)
            lps.append(comp.logprobs[pos])
            tops.append(top)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    # ---- whole responses -------------------------------------------------------------------------------
    def response(self, finals: list[RequestOutput]) -> dict:
        choices, n_prompt, n_out = [], 0, 0
        for i, out in enumerate(finals):
            n_prompt += len(out.prompt_token_ids)
            for comp in out.outputs:
                n_out += len(comp.token_ids)
                idx = i * self.n + comp.index
                if self.chat:
                    choices.append(
                        {
                            "index": idx,
                            "message": {"role": "assistant", "content": comp.text},
                            "logprobs": self._chat_logprobs(comp, 0, len(comp.token_ids)),
                            "finish_reason": comp.finish_reason,
                        }
                    )
                else:
                    echo = self.echo[i] if self.echo else ""
                    lp = self._completion_logprobs(
                        comp, 0, len(comp.token_ids), 0, out if self.echo else None
                    )
                    choices.append(
                        {
                            "index": idx,
                            "text": echo + comp.text,
                            "logprobs": lp,
                            "finish_reason": comp.finish_reason,
                        }
                    )
        choices.sort(key=lambda c: c["index"])
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(n_prompt, n_out),
        }

    # ---- streams ---------------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], with_usage: bool) -> dict:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if with_usage:
            body["usage"] = None
        return body

    def chunks(self, prompt_index: int, out: RequestOutput, with_usage: bool) -> list[dict]:
        """The chunks that one step's output of prompt `prompt_index` adds (none if nothing new)."""
        result = []
        for comp in out.outputs:
            ch = self._choice(prompt_index, comp)
            if ch.ended:  # n > 1: this completion ended in an earlier step, its siblings still run
                continue
            done = comp.finish_reason is not None
            ch.ended = done
            text, lo, hi = ch.delta(comp, self.stops, done)
            first = not ch.started
            if not text and lo == hi and not done and not first:
                continue
            ch.started = True
            if self.chat:
                if first:  # OpenAI's first delta carries the role
                    result.append(
                        self._chunk(
                            [
                                {
                                    "index": ch.index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                            with_usage,
                        )
                    )
                # a step whose token only extended held-back text sends nothing (unless logprobs were asked)
                if text or (lo < hi and self.k is not None) or done:
                    result.append(
                        self._chunk(
                            [
                                {
                                    "index": ch.index,
                                    "delta": {"content": text} if text else {},
                                    "logprobs": self._chat_logprobs(comp, lo, hi),
                                    "finish_reason": comp.finish_reason,
                                }
                            ],
                            with_usage,
                        )
                    )
            else:
                echo = ch.echo if first else ""
                offset = 0 if first else ch.lp_offset
                lp = self._completion_logprobs(comp, lo, hi, offset, out if (first and self.echo) else None)
                if lp is not None and lp["tokens"]:
                    ch.lp_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
                result.append(
                    self._chunk(
                        [
                            {
                                "index": ch.index,
                                "text": echo + text,
                                "logprobs": lp,
                                "finish_reason": comp.finish_reason,
                            }
                        ],
                        with_usage,
                    )
                )
        return result

    def usage_chunk(self, finals: dict[int, RequestOutput]) -> dict:
        n_prompt = sum(len(o.prompt_token_ids) for o in finals.values())
        n_out = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        body = self._chunk([], False)
        body["usage"] = usage(n_prompt, n_out)
        return body
