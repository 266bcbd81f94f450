"""The op catalog: every kiln kernel with its shapes, its FLOPs and bytes counted from them, and a builder
that makes inputs and returns a call of kiln's kernel. `kiln profile roofline` times the calls; `kiln
profile decode` uses the same counting for each kernel of a decode step.

Counting rules, the same for every op (each op's docstring says what it counts under them):
- bytes are the compulsory DRAM traffic: every input read once and every output written once, at the
  tensors' own element sizes. Re-reads from L2 or a second pass over the same rows are not counted, so
  a kernel that re-reads can show a "% of bound" it cannot reach; that is the point of the figure.
- FLOPs: a multiply-add is 2; for elementwise and reduction ops every arithmetic step per element is 1
  (exp, max, compare included), as listed per op. The matmul ops (and attention's two products) count
  only the products' 2*M*N*K: the rest is at most a few percent of them.
- `roof` names the compute ceiling that applies: the dtype's dense matmul rate for tensor-core ops
  ("bf16", "fp16", "fp8", "tf32"), the fp32 SIMT rate ("fp32", measured as an fp32 matmul with TF32
  off) for elementwise and reduction ops.

The arithmetic intensity of an op is flops() / bytes(); the bound on its time is
max(flops / peak[roof], bytes / bandwidth) (kiln.profile.roofline).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _gen(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _randn(shape, device, dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=device, generator=_gen(device)) * scale).to(dtype)


@dataclass(frozen=True)
class Op(ABC):
    """One kernel call at one shape. Subclasses give the shape fields, flops(), bytes() and build()."""

    name: str

    dtype = "bf16"
    roof = "fp32"

    @abstractmethod
    def flops(self) -> int:
        """FLOPs of one call, counted from the shape (the subclass's docstring says what counts)."""

    @abstractmethod
    def bytes(self) -> int:
        """Bytes one call moves to and from DRAM: each input read once, each output written once."""

    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops() / self.bytes()

    def shape_str(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if k not in ("name", "dtype")}
        return " ".join(f"{k}={v}" for k, v in fields.items())

    def build(self, device: torch.device) -> Callable[[], object]:
        """Make the inputs on `device` and return a zero-argument call of kiln's kernel on them. The ops
        that only count a decode step's kernels (argmax, casts, ...: not kiln kernels, not on the
        roofline) have none."""
        raise TypeError(f"{type(self).__name__} only counts FLOPs and bytes: it has no kernel to time")

    def _dt(self) -> torch.dtype:
        return TORCH_DTYPE[self.dtype]

    def _b(self) -> int:
        return ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class RMSNorm(Op):
    """rmsnorm(x (rows, cols), w (cols,)), with `residual`: norm(x + r) and the sum x + r.
    FLOPs per element: square, sum, scale by rstd, multiply by w = 4 (+1 for the residual add).
    Bytes: read x (and r) and w; write y (and the sum)."""

    rows: int = 1
    cols: int = 1
    residual: bool = False
    dtype: str = "bf16"

    def flops(self) -> int:
        return (4 + self.residual) * self.rows * self.cols

    def bytes(self) -> int:
        streams = 4 if self.residual else 2  # x, y (+ r in, sum out)
        return self._b() * (streams * self.rows * self.cols + self.cols)

    def build(self, device):
        from kiln.kernels.rmsnorm import rmsnorm

        x = _randn((self.rows, self.cols), device, self._dt())
        w = _randn((self.cols,), device, self._dt())
        r = _randn((self.rows, self.cols), device, self._dt()) if self.residual else None
        return lambda: rmsnorm(x, w, 1e-6, r)


@dataclass(frozen=True)
class LayerNorm(Op):
    """layernorm(x (rows, cols), w, b). FLOPs per element: sum for the mean, subtract, square, sum,
    scale by rstd, multiply by w, add b = 7. Bytes: read x, w, b; write y."""

    rows: int = 1
    cols: int = 1
    dtype: str = "bf16"

    def flops(self) -> int:
        return 7 * self.rows * self.cols

    def bytes(self) -> int:
        return self._b() * (2 * self.rows * self.cols + 2 * self.cols)

    def build(self, device):
        from kiln.kernels.layernorm import layernorm

        x = _randn((self.rows, self.cols), device, self._dt())
        w, b = _randn((self.cols,), device, self._dt()), _randn((self.cols,), device, self._dt())
        return lambda: layernorm(x, w, b)


@dataclass(frozen=True)
class Softmax(Op):
    """softmax(x (rows, cols)) over the last dim. FLOPs per element: max, subtract, exp, sum, divide = 5.
    Bytes: read x, write y."""

    rows: int = 1
    cols: int = 1
    dtype: str = "bf16"

    def flops(self) -> int:
        return 5 * self.rows * self.cols

    def bytes(self) -> int:
        return self._b() * 2 * self.rows * self.cols

    def build(self, device):
        from kiln.kernels.softmax import softmax

        x = _randn((self.rows, self.cols), device, self._dt())
        return lambda: softmax(x)


@dataclass(frozen=True)
class SwiGLU(Op):
    """silu(gate) * up from the fused (rows, 2 * hidden) [gate | up] tensor -> (rows, hidden).
    FLOPs per output: exp, add, divide (the sigmoid), times gate, times up = 5.
    Bytes: read 2 * hidden, write hidden per row."""

    rows: int = 1
    hidden: int = 1
    dtype: str = "bf16"

    def flops(self) -> int:
        return 5 * self.rows * self.hidden

    def bytes(self) -> int:
        return self._b() * 3 * self.rows * self.hidden

    def build(self, device):
        from kiln.kernels.swiglu import swiglu

        x = _randn((self.rows, 2 * self.hidden), device, self._dt())
        return lambda: swiglu(x, None)


@dataclass(frozen=True)
class RoPE(Op):
    """Rotate q (tokens, Hq, D) and k (tokens, Hk, D) by the float32 cos/sin tables (tokens, D/2) each.
    FLOPs: 4 multiplies and 2 adds per rotated pair = 3 per element. Bytes: read and write q and k,
    read both tables (tokens * D/2 float32 each)."""

    tokens: int = 1
    heads_q: int = 1
    heads_k: int = 1
    head_dim: int = 2
    dtype: str = "bf16"

    def flops(self) -> int:
        return 3 * self.tokens * (self.heads_q + self.heads_k) * self.head_dim

    def bytes(self) -> int:
        qk = self.tokens * (self.heads_q + self.heads_k) * self.head_dim
        return 2 * qk * self._b() + 2 * self.tokens * (self.head_dim // 2) * 4

    def build(self, device):
        from kiln.kernels.rope import apply_rope

        T, D = self.tokens, self.head_dim
        q = _randn((1, T, self.heads_q, D), device, self._dt())
        k = _randn((1, T, self.heads_k, D), device, self._dt())
        ang = torch.arange(T, device=device, dtype=torch.float32)[:, None] * torch.linspace(
            0, 1, D // 2, device=device
        )
        cos, sin = ang.cos(), ang.sin()
        pos = torch.arange(T, device=device)[None]
        return lambda: apply_rope(q, k, cos, sin, pos)


@dataclass(frozen=True)
class CrossEntropy(Op):
    """Forward loss of logits (rows, vocab) against int64 targets. FLOPs per logit: max, subtract, exp,
    sum = 4. Bytes: read the logits and targets, write one float32 loss per row."""

    rows: int = 1
    vocab: int = 1
    dtype: str = "bf16"

    def flops(self) -> int:
        return 4 * self.rows * self.vocab

    def bytes(self) -> int:
        return self._b() * self.rows * self.vocab + 8 * self.rows + 4 * self.rows

    def build(self, device):
        from kiln.kernels.cross_entropy import cross_entropy

        z = _randn((self.rows, self.vocab), device, self._dt())
        t = torch.randint(0, self.vocab, (self.rows,), device=device, generator=_gen(device))
        return lambda: cross_entropy(z, t)


@dataclass(frozen=True)
class LinearCrossEntropy(Op):
    """Forward loss of (hidden (rows, d) @ W (vocab, d).T) against targets, the logits never stored.
    FLOPs: the product 2 * rows * vocab * d (+ 4 per logit for the loss). Bytes: read hidden, W and
    targets, write one loss per row (the logits stay on chip)."""

    rows: int = 1
    vocab: int = 1
    d: int = 1
    dtype: str = "bf16"

    @property
    def roof(self) -> str:
        return self.dtype

    def flops(self) -> int:
        return 2 * self.rows * self.vocab * self.d + 4 * self.rows * self.vocab

    def bytes(self) -> int:
        return self._b() * (self.rows * self.d + self.vocab * self.d) + 12 * self.rows

    def build(self, device):
        from kiln.kernels.linear_cross_entropy import linear_cross_entropy

        h = _randn((self.rows, self.d), device, self._dt())
        w = _randn((self.vocab, self.d), device, self._dt(), 0.02)
        t = torch.randint(0, self.vocab, (self.rows,), device=device, generator=_gen(device))
        return lambda: linear_cross_entropy(h, w, t)


@dataclass(frozen=True)
class Linear(Op):
    """y (M, N) = x (M, K) @ W (N, K).T (+ bias (N,)), kiln.kernels.matmul.linear (the tile kernel for
    many rows, the decode kernels for <= 16). FLOPs: 2 * M * N * K (the bias add is not counted).
    Bytes: read x and W (and the bias), write y."""

    m: int = 1
    n: int = 1
    k: int = 1
    bias: bool = False
    dtype: str = "bf16"

    @property
    def roof(self) -> str:
        return self.dtype

    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def bytes(self) -> int:
        return self._b() * (self.m * self.k + self.n * self.k + self.m * self.n + self.bias * self.n)

    def build(self, device):
        from kiln.kernels.matmul import linear

        x = _randn((self.m, self.k), device, self._dt())
        w = _randn((self.n, self.k), device, self._dt(), self.k**-0.5)
        b = _randn((self.n,), device, self._dt()) if self.bias else None
        return lambda: linear(x, w, b)


@dataclass(frozen=True)
class Attention(Op):
    """Causal attention forward over (batch, seq, heads, head_dim) q and (.., kv_heads, ..) k, v.
    FLOPs: the two products, 4 * batch * heads * seq^2 * head_dim, halved for the causal mask (the
    FlashAttention convention). Bytes: read q, k, v, write o and the float32 log-sum-exp (batch, heads,
    seq)."""

    batch: int = 1
    seq: int = 1
    heads: int = 1
    kv_heads: int = 1
    head_dim: int = 1
    dtype: str = "bf16"

    @property
    def roof(self) -> str:
        return self.dtype

    def _qkvo(self) -> int:
        return self.batch * self.seq * (2 * self.heads + 2 * self.kv_heads) * self.head_dim * self._b()

    def flops(self) -> int:
        return 2 * self.batch * self.heads * self.seq * self.seq * self.head_dim

    def bytes(self) -> int:
        return self._qkvo() + 4 * self.batch * self.heads * self.seq

    def _inputs(self, device, grad: bool):
        B, T, D = self.batch, self.seq, self.head_dim
        q = _randn((B, T, self.heads, D), device, self._dt()).requires_grad_(grad)
        k = _randn((B, T, self.kv_heads, D), device, self._dt()).requires_grad_(grad)
        v = _randn((B, T, self.kv_heads, D), device, self._dt()).requires_grad_(grad)
        return q, k, v

    def build(self, device):
        from kiln.kernels.attention import attention

        q, k, v = self._inputs(device, False)
        return lambda: attention(q, k, v, causal=True)


@dataclass(frozen=True)
class AttentionBwd(Attention):
    """Causal attention backward: dq, dk, dv from do. FLOPs: the five products, 2.5 x the forward's
    (10 * batch * heads * seq^2 * head_dim, halved for the mask). Bytes: read q, k, v, o, do and the
    log-sum-exp, write dq, dk, dv (float32 row sums of o * do, written and read back, not counted)."""

    def flops(self) -> int:
        return 5 * self.batch * self.heads * self.seq * self.seq * self.head_dim

    def bytes(self) -> int:
        q = self.batch * self.seq * self.heads * self.head_dim * self._b()
        kv = self.batch * self.seq * self.kv_heads * self.head_dim * self._b()
        # in: q, k, v, o, do (3 q-sized, 2 kv-sized) and the lse; out: dq, dk, dv
        return (3 * q + 2 * kv) + 4 * self.batch * self.heads * self.seq + (q + 2 * kv)

    def build(self, device):
        from kiln.kernels.attention import attention

        q, k, v = self._inputs(device, True)
        o = attention(q, k, v, causal=True)
        do = torch.randn_like(o)
        return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)


@dataclass(frozen=True)
class DecodeAttention(Op):
    """One decode step of attention, paged cache: q (batch, heads, D) against `context` cached keys and
    values per sequence (kv_heads each). FLOPs: 4 * batch * heads * context * D (both products).
    Bytes: read the K and V pages (2 * batch * context * kv_heads * D), q and the int32 block tables and
    lengths, write o (batch, heads, D)."""

    batch: int = 1
    context: int = 1
    heads: int = 1
    kv_heads: int = 1
    head_dim: int = 1
    block_size: int = 16
    dtype: str = "bf16"

    @property
    def roof(self) -> str:
        return self.dtype

    def flops(self) -> int:
        return 4 * self.batch * self.heads * self.context * self.head_dim

    def bytes(self) -> int:
        kv = 2 * self.batch * self.context * self.kv_heads * self.head_dim * self._b()
        qo = 2 * self.batch * self.heads * self.head_dim * self._b()
        tables = 4 * self.batch * (math.ceil(self.context / self.block_size) + 1)
        return kv + qo + tables

    def build(self, device):
        from kiln.kernels.decode_attention import decode_attention

        B, bs = self.batch, self.block_size
        pages = math.ceil(self.context / bs)
        kc = _randn((B * pages, bs, self.kv_heads, self.head_dim), device, self._dt())
        vc = _randn((B * pages, bs, self.kv_heads, self.head_dim), device, self._dt())
        q = _randn((B, self.heads, self.head_dim), device, self._dt())
        # each sequence owns its pages, shuffled so that reads are not one sequential stream
        perm = torch.randperm(B * pages, generator=torch.Generator().manual_seed(0)).to(torch.int32)
        table = perm.view(B, pages).to(device)
        lens = torch.full((B,), self.context, dtype=torch.int32, device=device)
        return lambda: decode_attention(q, kc, vc, table, lens)


@dataclass(frozen=True)
class PagedKVWrite(Op):
    """Write k, v (tokens, kv_heads, D) into the paged cache at int64 slots. FLOPs: none (0).
    Bytes: read k, v and the slots, write the same bytes of cache."""

    tokens: int = 1
    kv_heads: int = 1
    head_dim: int = 1
    dtype: str = "bf16"

    def flops(self) -> int:
        return 0

    def bytes(self) -> int:
        return 4 * self.tokens * self.kv_heads * self.head_dim * self._b() + 8 * self.tokens

    def build(self, device):
        from kiln.kernels.paged_kv import paged_kv_write

        T, H, D = self.tokens, self.kv_heads, self.head_dim
        kc = torch.zeros((T, 1, H, D), device=device, dtype=self._dt())
        vc = torch.zeros_like(kc)
        k, v = _randn((T, H, D), device, self._dt()), _randn((T, H, D), device, self._dt())
        slots = torch.arange(T, device=device)
        return lambda: paged_kv_write(kc, vc, k, v, slots)


@dataclass(frozen=True)
class Sampling(Op):
    """Temperature / top-k / top-p sampling of one token per row of float32 logits (rows, vocab), with
    the Exp(1) noise drawn on the device first (part of kiln's `sample`). FLOPs per logit: a nominal 5
    (scale, exp, noise division, compare, sum). Bytes: write and read the float32 noise, read the
    logits, write one int64 id per row."""

    rows: int = 1
    vocab: int = 1
    dtype: str = "fp32"

    def flops(self) -> int:
        return 5 * self.rows * self.vocab

    def bytes(self) -> int:
        return 3 * 4 * self.rows * self.vocab + 8 * self.rows

    def build(self, device):
        from kiln.kernels.sampling import sample

        z = _randn((self.rows, self.vocab), device, torch.float32, 3.0)
        g = torch.Generator(device=device).manual_seed(0)
        return lambda: sample(z, 0.8, 50, 0.9, g)


@dataclass(frozen=True)
class QuantLinear(Op):
    """y (M, N) = x (M, K) @ dequant(Wq).T (+ bias (N,)) with int8 (per-channel scales (N, 1)) or int4
    weights (two per byte, one bf16 scale per `group` inputs; with `zeros`, a uint8 zero point per group
    too). FLOPs: 2 * M * N * K. Bytes: read x, the packed weight (N * K * bits / 8), the scales, the zero
    points and the bias, write y."""

    m: int = 1
    n: int = 1
    k: int = 1
    bits: int = 8
    group: int = 128
    zeros: bool = False
    bias: bool = False
    dtype: str = "bf16"

    @property
    def roof(self) -> str:
        return self.dtype

    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def _scales(self) -> int:
        return self.n * (1 if self.bits == 8 else self.k // self.group)

    def bytes(self) -> int:
        w = self.n * self.k * self.bits // 8
        zeros = self._scales() if self.zeros and self.bits == 4 else 0
        return (
            w
            + 2 * self._scales()
            + zeros
            + self._b() * (self.m * self.k + self.m * self.n + self.bias * self.n)
        )

    def build(self, device):
        from kiln.kernels.quant_matmul import wq_linear

        g = _gen(device)
        x = _randn((self.m, self.k), device, self._dt())
        if self.bits == 8:
            qw = torch.randint(-127, 128, (self.n, self.k), device=device, generator=g, dtype=torch.int8)
            s = (torch.rand((self.n, 1), device=device, generator=g) * 0.01).to(self._dt())
        else:
            qw = torch.randint(0, 256, (self.n, self.k // 2), device=device, generator=g, dtype=torch.uint8)
            s = (torch.rand((self.n, self.k // self.group), device=device, generator=g) * 0.01).to(self._dt())
        z = None
        if self.zeros and self.bits == 4:
            z = torch.randint(
                0, 16, (self.n, self.k // self.group), device=device, generator=g, dtype=torch.uint8
            )
        b = _randn((self.n,), device, self._dt()) if self.bias else None
        return lambda: wq_linear(x, qw, s, z, self.bits, self.group, b)


@dataclass(frozen=True)
class FP8Linear(Op):
    """y (M, N) = x (M, K) @ W (N, K).T with an FP8 e4m3 weight (per-row float32 scales) and x quantized
    per row on the fly (kiln.kernels.fp8_matmul). FLOPs: 2 * M * N * K. Bytes: read x (16-bit) and the
    FP8 weight and scales, write y (16-bit); the FP8 copy of x, written and read back, is not counted."""

    m: int = 1
    n: int = 1
    k: int = 1
    dtype: str = "bf16"
    roof = "fp8"

    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def bytes(self) -> int:
        return self._b() * (self.m * self.k + self.m * self.n) + self.n * self.k + 4 * self.n

    def build(self, device):
        from kiln.kernels.fp8_matmul import fp8_linear, quantize_fp8

        x = _randn((self.m, self.k), device, self._dt())
        w_q, w_s = quantize_fp8(_randn((self.n, self.k), device, self._dt(), self.k**-0.5), per_row=True)
        return lambda: fp8_linear(x, w_q, w_s)


@dataclass(frozen=True)
class GroupedLinear(Op):
    """The MoE grouped GEMM: rows (R, K) sorted by expert, `experts` weights (E, N, K), rows split evenly
    among the experts. FLOPs: 2 * R * N * K. Bytes: read x and every expert's weight, write y (R, N)
    (plus the (E + 1) int32 offsets)."""

    rows: int = 1
    n: int = 1
    k: int = 1
    experts: int = 1
    dtype: str = "bf16"

    @property
    def roof(self) -> str:
        return self.dtype

    def flops(self) -> int:
        return 2 * self.rows * self.n * self.k

    def bytes(self) -> int:
        return self._b() * (self.rows * self.k + self.experts * self.n * self.k + self.rows * self.n) + 4 * (
            self.experts + 1
        )

    def build(self, device):
        from kiln.kernels.moe_gemm import grouped_linear

        x = _randn((self.rows, self.k), device, self._dt())
        w = _randn((self.experts, self.n, self.k), device, self._dt(), self.k**-0.5)
        offs = torch.linspace(0, self.rows, self.experts + 1).round().to(torch.int32).to(device)
        return lambda: grouped_linear(x, w, offs)


@dataclass(frozen=True)
class Embedding(Op):
    """Gather `rows` rows of a (vocab, d) table. FLOPs: 0. Bytes: read the int64 ids and the rows read,
    write (rows, d)."""

    rows: int = 1
    d: int = 1
    dtype: str = "bf16"

    def flops(self) -> int:
        return 0

    def bytes(self) -> int:
        return 8 * self.rows + 2 * self.rows * self.d * self._b()


@dataclass(frozen=True)
class Argmax(Op):
    """argmax over the last dim of (rows, vocab). FLOPs: one compare per element. Bytes: read the
    logits, write one int64 per row."""

    rows: int = 1
    vocab: int = 1
    dtype: str = "bf16"

    def flops(self) -> int:
        return self.rows * self.vocab

    def bytes(self) -> int:
        return self._b() * self.rows * self.vocab + 8 * self.rows


@dataclass(frozen=True)
class Cast(Op):
    """A dtype conversion of `numel` elements (the eager path's float32 logits). FLOPs: 0. Bytes: read
    at the source size, write at the destination size (src_bytes, dst_bytes per element)."""

    numel: int = 1
    src_bytes: int = 2
    dst_bytes: int = 4

    def flops(self) -> int:
        return 0

    def bytes(self) -> int:
        return self.numel * (self.src_bytes + self.dst_bytes)


def catalog(smoke: bool = False) -> list[Op]:
    """Every kiln kernel at its benchmark's headline shape (bench/<area>.py), bf16 on the GPU.
    smoke: tiny shapes (and fp16/fp32, which the CPU interpreter computes) to check the calls run."""
    if smoke:
        dt = "fp16"
        return [
            RMSNorm("rmsnorm", rows=8, cols=64, dtype="fp32"),
            LayerNorm("layernorm", rows=8, cols=64, dtype="fp32"),
            Softmax("softmax", rows=8, cols=64, dtype="fp32"),
            SwiGLU("swiglu", rows=8, hidden=32, dtype="fp32"),
            RoPE("rope", tokens=8, heads_q=4, heads_k=2, head_dim=16, dtype="fp32"),
            CrossEntropy("cross_entropy", rows=8, vocab=64, dtype="fp32"),
            LinearCrossEntropy("linear_cross_entropy", rows=16, vocab=64, d=32, dtype="fp32"),
            Linear("matmul_prefill", m=32, n=32, k=32, dtype=dt),
            Linear("matmul_decode", m=1, n=64, k=32, dtype=dt),
            DecodeAttention(
                "decode_attention", batch=2, context=40, heads=4, kv_heads=2, head_dim=16, dtype=dt
            ),
            PagedKVWrite("paged_kv_write", tokens=4, kv_heads=2, head_dim=16, dtype=dt),
            Sampling("sampling", rows=2, vocab=64),
            QuantLinear("quant_matmul_int8", m=1, n=32, k=64, bits=8, dtype=dt),
            QuantLinear("quant_matmul_int4", m=1, n=32, k=64, bits=4, group=32, dtype=dt),
            FP8Linear("fp8_matmul", m=16, n=32, k=64),
            GroupedLinear("moe_grouped_gemm", rows=32, n=32, k=32, experts=4, dtype=dt),
            Attention("attention_fwd", batch=1, seq=32, heads=2, kv_heads=2, head_dim=16, dtype=dt),
            AttentionBwd("attention_bwd", batch=1, seq=32, heads=2, kv_heads=2, head_dim=16, dtype=dt),
        ]
    qwen = dict(heads=12, kv_heads=2, head_dim=128)
    return [
        RMSNorm("rmsnorm", rows=32768, cols=4096),
        LayerNorm("layernorm", rows=32768, cols=4096),
        Softmax("softmax", rows=32768, cols=4096),
        SwiGLU("swiglu", rows=32768, hidden=8960),
        RoPE("rope", tokens=4 * 4096, heads_q=32, heads_k=8, head_dim=128),
        CrossEntropy("cross_entropy", rows=8192, vocab=151936),
        LinearCrossEntropy("linear_cross_entropy", rows=8192, vocab=151936, d=1536),
        Linear("matmul_prefill", m=4096, n=4096, k=4096),
        Linear("matmul_decode", m=1, n=17920, k=1536),
        DecodeAttention("decode_attention", batch=64, context=1024, **qwen),
        PagedKVWrite("paged_kv_write", tokens=64, kv_heads=2, head_dim=128),
        Sampling("sampling", rows=64, vocab=151936),
        QuantLinear("quant_matmul_int8", m=1, n=17920, k=1536, bits=8),
        QuantLinear("quant_matmul_int4", m=1, n=17920, k=1536, bits=4, group=128),
        FP8Linear("fp8_matmul", m=4096, n=4096, k=4096),
        GroupedLinear("moe_grouped_gemm", rows=4096 * 8, n=768 * 2, k=2048, experts=128),
        # last: their autotuners compile and time many configs on the first call
        Attention("attention_fwd", batch=4, seq=4096, heads=16, kv_heads=16, head_dim=128),
        AttentionBwd("attention_bwd", batch=4, seq=4096, heads=16, kv_heads=16, head_dim=128),
    ]
