"""transformers' `generate` on a kiln model's weights: bench/infer.py's HF peer.

`hf_from_kiln` builds the transformers class of the model's family from kiln's own export
(kiln.model.hf.config_to_hf / state_to_hf, the path `save_pretrained` takes) and loads the same tensors, so
the peer computes the function kiln computes (SDPA attention, transformers' default). `timed_generate`
times greedy generation with a fixed number of new tokens (min_new_tokens = max_new_tokens: no early
stop); the decode rate comes from two runs, one of 1 token (the prefill) and one of 1 + n.
`static=True` asks generate for a static cache, which transformers compiles automatically
(torch.compile of the decoding forward) on CUDA. `static_batch` runs prompts of different lengths as one
left-padded batch (bench/infer.py's throughput peer).
"""

from __future__ import annotations

import time

import torch

from kiln.model.hf import state_to_hf
from kiln.model.hf_config import config_to_hf


def hf_from_kiln(model):
    """A transformers causal LM (eval mode) with a copy of `model`'s weights, on its device and dtype."""
    import transformers

    w = model.head_weight
    d = config_to_hf(model.config, str(w.dtype).removeprefix("torch."))
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device(w.device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=w.dtype)
    missing, unexpected = hf.load_state_dict(state_to_hf(model.config, model.state_dict()), strict=False)
    tied = {"lm_head.weight"} if model.config.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"HF peer: weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return hf.eval()


@torch.no_grad()
def timed_generate(hf, prompt: torch.Tensor, n: int, static: bool = False) -> tuple[torch.Tensor, float]:
    """Greedy: prompt (B, P) -> (its n new ids (B, n), wall seconds, synchronized)."""
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    if static:
        kw["cache_implementation"] = "static"
    _sync(prompt.device)
    t = time.perf_counter()
    out = hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
    _sync(prompt.device)
    return out[:, prompt.shape[1] :], time.perf_counter() - t


def decode_rate(hf, prompt: torch.Tensor, n: int, static: bool = False) -> dict:
    """TTFT (a 1-token generate) and decode tok/s = B * n / (time of a (1 + n)-token generate - TTFT)."""
    _, ttft = timed_generate(hf, prompt, 1, static)
    _, total = timed_generate(hf, prompt, 1 + n, static)
    B = prompt.shape[0]
    return {"ttft_s": round(ttft, 5), "tok_s": round(B * n / (total - ttft), 1) if total > ttft else None}


@torch.no_grad()
def static_batch(hf, prompts: list[list[int]], n: int) -> tuple[torch.Tensor, dict]:
    """Greedy, one static batch: prompts of any lengths left-padded to the longest (attention mask zero on
    the padding: generate derives each row's positions from it), n new ids each -> (ids (B, n), timings:
    ttft_s of a 1-token generate of the same batch, total_s of the n-token one)."""
    P = max(len(p) for p in prompts)
    dev = hf.device
    ids = torch.zeros(len(prompts), P, dtype=torch.int64)
    mask = torch.zeros(len(prompts), P, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = torch.tensor(p)
        mask[b, P - len(p) :] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=mask)
    times = []
    for steps in (1, n):
        _sync(dev)
        t = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kw)
        _sync(dev)
        times.append(time.perf_counter() - t)
    return out[:, P:], {"ttft_s": times[0], "total_s": times[1]}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
