"""What crosses the pipe from the engine process each step: the change of every output, not its state.

The engine's RequestOutputs are cumulative (every step carries all the tokens, logprobs and text so far).
Pickling those each step would cost O(length) per request per step, so the engine process sends a delta
per output and the server process rebuilds the cumulative RequestOutput from its own lists:

    (key, prompt index, finished, prompt, new prompt logprobs, metrics, completions)
      prompt:       (prompt text or None, prompt token ids) on a request's first output, else None
      prompt logprobs: None (not asked), else the ones computed since the last send (chunked prefill)
      metrics:      the engine's timings once finished, else None
      completions:  one (index, new token ids, new logprobs, new top logprobs, keep, append, finish_reason,
                    stop_reason) per completion that changed (every one in a request's first output)

Token ids and logprobs only grow. The text usually grows too, but not always: a trailing U+FFFD (a
character cut between tokens) is replaced once its last byte arrives, and a stop string cuts the text
back. So the text travels as (keep, append): the new text is the old text's first `keep` characters
followed by `append` (the whole text, keep = 0, when nothing else fits).
"""

from __future__ import annotations

from kiln.infer.engine import CompletionOutput, RequestOutput


class _SentCompletion:
    __slots__ = ("tokens", "text", "finish")

    def __init__(self):
        self.tokens, self.text, self.finish = 0, "", None


class DeltaEncoder:
    """Engine-process side: remembers what was sent per request; a finished request is forgotten.

    `encode` takes a RequestOutput (the engine's `step()`; a finished request's last state). `encode_live`
    reads a running request's state in the engine itself (LLMEngine.requests: the fields the engine's
    `_output` copies), so the engine process can step with `finished_only=True` and skip the engine's
    per-step copy of every token list: its per-step cost is then the new tokens', not the lengths'."""

    def __init__(self):
        # request id -> (per completion what was sent, prompt logprobs sent)
        self._sent: dict[str, tuple[list[_SentCompletion], list[int]]] = {}

    def encode(self, key: int, i: int, out: RequestOutput) -> tuple:
        comps = [
            (c.index, c.token_ids, c.logprobs, c.top_logprobs, c.text, c.finish_reason, c.stop_reason)
            for c in out.outputs
        ]
        prompt = (out.prompt, out.prompt_token_ids)
        delta = self._encode(key, i, out.request_id, out.finished, prompt, out.prompt_logprobs, comps)
        return delta[:5] + (out.metrics,) + delta[6:] if out.finished else delta

    def encode_live(self, key: int, i: int, req) -> tuple | None:
        """The delta of an unfinished engine request (kiln.infer.engine._Request), None if nothing moved."""
        state = self._sent.get(req.request_id)
        first = state is None
        seqs = req.seqs
        params = req.params
        if not first and len(seqs) == 1 and params.logprobs is None and params.prompt_logprobs is None:
            # the common case, once per running request per step in the engine process: one completion
            # and no logprobs, so only its new token ids and its text's change (what _encode gives)
            s, seq, text = state[0][0], seqs[0], req.texts[0]
            ids, finish = seq.output_token_ids, seq.finish_reason
            n = len(ids)
            if n == s.tokens and text is s.text and finish == s.finish:
                return None
            keep, append = _text_delta(s.text, text)
            comp = (0, ids[s.tokens :], None, None, keep, append, finish, seq.stop_reason)
            s.tokens, s.text, s.finish = n, text, finish
            return (key, i, False, None, None, None, [comp])
        if first and not any(s.output_token_ids or s.finish_reason for s in seqs):
            return None  # waiting, or its prompt still in prefill: nothing to send yet
        want = req.params.logprobs is not None
        comps = [
            (
                j,
                seq.output_token_ids,
                seq.output_logprobs if want else None,
                seq.output_top_logprobs if want else None,
                req.texts[j],
                seq.finish_reason,
                seq.stop_reason,
            )
            for j, seq in enumerate(seqs)
        ]
        plp = seqs[0].prompt_logprobs if req.params.prompt_logprobs is not None else None
        delta = self._encode(key, i, req.request_id, False, (req.prompt, req.prompt_ids), plp, comps)
        return delta if (delta[6] or delta[4]) else None

    def _encode(self, key, i, rid: str, finished: bool, prompt, plp_all, comps_all) -> tuple:
        """comps_all: per completion (index, token ids, logprobs, top logprobs, text, finish, stop reason),
        the cumulative state (the slices taken here are new lists: nothing the engine appends to later)."""
        state = self._sent.get(rid)
        first = state is None
        if first:
            state = ([_SentCompletion() for _ in comps_all], [0])
            if not finished:
                self._sent[rid] = state
        elif finished:
            del self._sent[rid]
        sent, plp_sent = state
        plp = None
        if plp_all is not None:
            plp = plp_all[plp_sent[0] :]
            plp_sent[0] = len(plp_all)
        comps = []
        for (j, ids, lps, tops, text, finish, stop), s in zip(comps_all, sent):
            n = len(ids)
            if not first and n == s.tokens and text is s.text and finish == s.finish:
                continue  # nothing new (a sibling completion moved, or this one finished before)
            keep, append = _text_delta(s.text, text)
            comps.append(
                (
                    j,
                    ids[s.tokens :],
                    None if lps is None else lps[s.tokens :],
                    None if tops is None else [list(t) for t in tops[s.tokens :]],
                    keep,
                    append,
                    finish,
                    stop,
                )
            )
            s.tokens, s.text, s.finish = n, text, finish
        return (key, i, finished, prompt if first else None, plp, None, comps)


def _text_delta(old: str, new: str) -> tuple[int, str]:
    if new is old or new.startswith(old):
        return len(old), new[len(old) :]
    stable = old.rstrip("\ufffd")  # a cut character completed by this step's token
    if new.startswith(stable):
        return len(stable), new[len(stable) :]
    if old.startswith(new):  # a stop string cut the text back
        return len(new), ""
    return 0, new


class _Request:
    """Server-process side: one request's cumulative state, in lists of its own."""

    __slots__ = ("prompt", "prompt_ids", "prompt_logprobs", "comps")

    def __init__(self, prompt, prompt_ids):
        self.prompt, self.prompt_ids = prompt, prompt_ids
        self.prompt_logprobs: list | None = None
        self.comps: dict[int, CompletionOutput] = {}


class DeltaDecoder:
    """Server-process side: `apply(delta)` updates a request's state and returns (key, prompt index);
    `output(key, i, finished, metrics, copy)` is its RequestOutput. copy=True gives fresh lists (a
    handler holding the output never sees a later step's tokens); a finished request's own lists are
    handed over (nothing extends them again) and the request is forgotten."""

    def __init__(self):
        self._reqs: dict[tuple[int, int], _Request] = {}

    def apply(self, delta: tuple) -> tuple[int, int]:
        key, i, _finished, prompt, plp, _metrics, comps = delta
        req = self._reqs.get((key, i))
        if req is None:
            req = self._reqs[(key, i)] = _Request(*prompt)
        if plp is not None:
            req.prompt_logprobs = (req.prompt_logprobs or []) + plp
        for j, ids, lps, tops, keep, append, finish, stop in comps:
            c = req.comps.get(j)
            if c is None:
                c = req.comps[j] = CompletionOutput(
                    j, "", [], None, None, None if lps is None else [], None if tops is None else []
                )
            c.token_ids.extend(ids)
            if lps is not None:
                c.logprobs.extend(lps)
            if tops is not None:
                c.top_logprobs.extend(tops)
            c.text = c.text[:keep] + append if keep < len(c.text) or append else c.text
            c.finish_reason, c.stop_reason = finish, stop
        return key, i

    def output(self, key: int, i: int, finished: bool, metrics: dict | None, copy: bool) -> RequestOutput:
        req = self._reqs[(key, i)]
        comps = [req.comps[j] for j in sorted(req.comps)]
        plp = req.prompt_logprobs
        if finished:
            del self._reqs[(key, i)]
        elif copy:
            comps = [
                CompletionOutput(
                    c.index,
                    c.text,
                    list(c.token_ids),
                    c.finish_reason,
                    c.stop_reason,
                    None if c.logprobs is None else list(c.logprobs),
                    None if c.top_logprobs is None else list(c.top_logprobs),
                )
                for c in comps
            ]
            plp = None if plp is None else list(plp)
        return RequestOutput(
            f"{key}-{i}", req.prompt, req.prompt_ids, comps, finished, plp, dict(metrics or {})
        )

    def __len__(self) -> int:
        return len(self._reqs)
