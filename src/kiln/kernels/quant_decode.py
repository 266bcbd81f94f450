"""Weight-only INT4/INT8 decode matmuls (1-16 rows) that dequantize without conversion instructions.

y (M, N) = x (M, K) @ dequant(W).T, W in kernels/quant_matmul.py's formats, read here as int32 words:
    int4: qweight uint8 (N, K / 2) viewed as int32 (N, K / 8): word j holds columns 8j .. 8j + 7, column
          8j + i in bits 4i .. 4i + 3 (pack_int4's nibble order, little-endian bytes);
    int8: qweight int8 (N, K) viewed as int32 (N, K / 4): word j holds columns 4j .. 4j + 3, byte i each.
(The views are free on the host: quant_matmul's launcher makes them; a weight whose rows are not 4-byte
aligned cannot take these forms.)

Why: the first decode kernels turned each weight into float32 with a conversion instruction (I2F, and F2F
to bf16 before tl.dot). Hopper issues conversions at 16 per SM per clock, an eighth of its FP32 rate:
the 151936 x 1536 head has 233M weights, at least 56 us of conversions on 132 SMs at 1.98 GHz, while
its int4 bytes stream in about 30 us. Here a weight becomes a float by bit operations (the trick of
FasterTransformer and Marlin): a small integer u OR-ed into the mantissa of a float whose unit in the
last place is 1 is that float plus u, exactly:
    float32: bits 0x4B000000 | u          = 2**23 + u        (u < 2**23)
    "magic" in x's dtype: MAGIC | u << SH = 128 + u          (u < 128; bf16 0x4300, fp16 0x5800 << 0 with
                                                             u << 3, float32 0x43000000 with u << 16)
and one float subtraction removes the offset and the zero point at once: (2**23 + q) - (2**23 + z) = q - z.

Two forms, both over a grid (cdiv(N, BLOCK_N), SPLIT_K) with matmul_decode's deterministic split-K sum:
- "fma" (M = 1): float32 FMAs, no tensor cores. A (BLOCK_N, BLOCK_W) tile of words is unpacked into its
  P values (P = 8 nibbles or 4 bytes per word, taken apart in the thread that loaded it), multiplied
  by x's matching columns and summed over P in the thread: a per-word partial (BLOCK_N, BLOCK_W) that
  takes its word's scale once (one multiply per 8 int4 weights instead of one per weight), accumulated
  across K and summed over words at the end. A field is not shifted down to the units place: it is OR-ed
  in place under the exponent that makes its lowest bit worth 1 (2**(23 - 4p) for nibble p,
  `_nibble_times_x`), so per int4 weight: one LOP3 (an inline `lop3.b32`), one subtraction and one FMA,
  and one shift per word for the three nibbles past bit 22; the products are added one at a time (FMAs).
  Compiled for sm_90 at the 8 x 256 tile: 8.0 SASS instructions a weight in the loop, from 9.7 (shift,
  sign-extend and OR per nibble, and pairs of products as a multiply, an FMA and an add; 8.8 with the
  AND-OR as two LOP3). Of the rest, two costs are gone where they can be (ROW_SCALE, X_PAIRS): a K step
  that lies inside one int4 group (GROUP % BLOCK_K == 0) loads one scale (and zero point) a row instead
  of one a word, with its address computed per word (~10 instructions a word), and a step of two whole
  groups two a row, each word selecting its own (TWO_GROUPS); and a contiguous bf16 x is
  read as int32 pairs, each half widened to float32 by one shift or one AND instead of Triton's PRMT +
  IMAD per value and row. 4.9-5.0 instructions a weight at 32 x 128 on 2 warps, the same bits (tested);
  on the H200 the one-row int4-g128 head went 73.9 -> 52.4 us, gate_up 11.7 -> 10.4 us (the sweep's new
  128-wide tiles, bench/results/archive/quant_sweep-d3a752d.json; docs/quant.md).
- "mma" (M <= 16): W is the tensor-core M side as in matmul_decode's "dot" form, dequantized in x's
  dtype by the magic. int4: v = bits(MAGIC | q << SH) = 128 + q, w = v - (128 + z) = q - z, exact in
  bf16/fp16/float32 (small integers). With a 16-bit x a byte's two nibbles (two adjacent columns) come out
  of one PRMT and one LOP3 as one register of two such floats, the pair the tile's layout keeps together,
  and the subtraction runs on both (HADD2): 3.8 SASS instructions a weight at 64 x 128 (sm_90), from 5.0
  for a nibble at a time (a shift and a LOP3 each, then PRMTs to pack pairs);
  acc_g (BLOCK_N, 16) = w @ x.T per K step inside one group, then
  acc += acc_g * s (the scale applied to the float32 partial, once per row and group, never rounded into
  the weight); BLOCK_K divides the group. int8: q + 128 has 8 bits, one more than bf16 holds at 128's
  place, so it goes as two nibbles, q = ((128 + hi) - 136) * 16 + ((128 + lo) - 128), exact at each step;
  the per-channel scale applied once at the end.
Float32 accumulation throughout; the output in x's dtype. The fma form also takes the SwiGLU of a merged
[gate | up] projection in its epilogue (GLU, unsplit K), as the bf16 gemv does (kernels/matmul_decode.py's
_w_block_rows and _swiglu_epilogue): a block's rows are gate and up rows of the same features, interleaved,
and it stores silu(gate) * up (1, N / 2) with the bits of the projection followed by kiln's SwiGLU kernel.
That form lets the next kernel be scheduled only once its output is stored (`_fma_wait`): scheduled at its
start like every other fma launch, the down projection behind it cost 13% of the int8 step at batch 1 on
the H200 (docs/quant.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kiln.kernels._common import pdl_prologue
from kiln.kernels.matmul_decode import _store, _swiglu_epilogue, _w_block_rows

# Bits of 128.0 in each activation dtype and the shift that puts an integer u < 128 at its units place.
MAGIC = {torch.bfloat16: (0x4300, 0), torch.float16: (0x5800, 3), torch.float32: (0x43000000, 16)}


@triton.jit
def _magic_128(u, MAGIC: tl.constexpr, SH: tl.constexpr, OUT: tl.constexpr):
    """Integers u in [0, 128) (int32) -> 128 + u exactly, in OUT's float dtype, by bits alone."""
    v = (u << SH) | MAGIC
    if OUT.primitive_bitwidth == 16:
        v = v.to(tl.int16)
    return v.to(OUT, bitcast=True)


@triton.jit
def _int8_times_x(w, i: tl.constexpr, x):
    """Byte i of every word of w as float32 q (its sign bit flipped: q + 128, then 2**23 + 128 removed)."""
    q = ((((w >> (8 * i)) & 255) ^ 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    return q * x[None, :]


@triton.jit
def _nibble_times_x(w, p: tl.constexpr, off, x, ASM: tl.constexpr):
    """Nibble p (0-4) of every word of w (BLOCK_N, BLOCK_W): bits 4p .. 4p + 3, left where they are, OR-ed
    under the exponent of 2**(23 - 4p), whose mantissa's last place is 2**(-4p): the float32 2**(23 - 4p) +
    u, u the nibble's value, with no shift (the nibble must lie in the mantissa, bits 0-22). Minus off
    (2**(23 - 4p) + the zero point) it is the exact integer q - z; times x (BLOCK_W,), the float32 x at each
    word's column of that nibble. ASM: the AND-OR as one `lop3.b32` (mask and exponent passed as registers,
    so ptxas keeps one as its immediate and the other in a register hoisted out of the loop; written as
    `(w & mask) | exp`, both constants are immediates and a LOP3 takes one, so it emits two); the
    interpreter, which runs no PTX, takes that spelling, with the same bits."""
    mask: tl.constexpr = 15 << (4 * p)
    exp: tl.constexpr = (150 - 4 * p) << 23
    if ASM:
        m = tl.full(w.shape, mask, tl.int32)
        e = tl.full(w.shape, exp, tl.int32)
        f = tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, $3, 0xea;", "=r,r,r,r", [w, m, e], dtype=tl.int32, is_pure=True, pack=1
        )  # 0xea: (a & b) | c
    else:
        f = (w & mask) | exp
    q = f.to(tl.float32, bitcast=True) - off
    return q * x[None, :]


@triton.jit
def _pair_lo(p):
    """The bf16 in the low half of each int32 p, as float32 (exact: a bf16 is a float32's upper half)."""
    return (p << 16).to(tl.float32, bitcast=True)


@triton.jit
def _pair_hi(p):
    """The bf16 in the high half of each int32 p, as float32."""
    return (p & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _wq_fma_kernel(
    X_ptr,  # (1, K) activations: x[k] at X_ptr + k * stride_xk
    W_ptr,  # int32 words (N, K / P): int4 P = 8, int8 P = 4 (module docstring), row stride stride_wn
    S_ptr,  # (N, K / GROUP) scales (int8: (N, 1)), row stride stride_sn
    Z_ptr,  # uint8 (N, K / GROUP) zero points, read when HAS_ZERO
    Y_ptr,  # (1, N) contiguous output; with SPLIT_K > 1 a float32 (SPLIT_K, 1, N) partial-sum buffer
    Bias_ptr,  # (N,), read when HAS_BIAS (and SPLIT_K == 1)
    M,  # 1
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_sn,
    k_split,  # K range of one split: a multiple of BLOCK_K (K when SPLIT_K == 1)
    BITS: tl.constexpr,  # 4 or 8
    GROUP: tl.constexpr,  # int4 group size (int8: unused)
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # columns per K step: BLOCK_W = BLOCK_K / P words
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
    ASM: tl.constexpr,  # int4: each nibble's AND-OR as one lop3.b32 (not under the interpreter)
    X_PAIRS: tl.constexpr = False,  # bf16 x read as int32 pairs (contiguous, 4-byte aligned, K even)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kiln.kernels._common.pdl)
    PRE: tl.constexpr = False,  # the first K step's words loaded before the PDL wait (launcher: `preload`)
    GLU: tl.constexpr = False,  # Y (1, N / 2) = swiglu(x @ W.T + bias) of W's [gate | up] rows (SPLIT_K 1)
):
    if not PRE:
        _fma_wait(PDL, GLU)
    P: tl.constexpr = 32 // BITS  # values per word
    BLOCK_W: tl.constexpr = BLOCK_K // P
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # (BLOCK_N,) W rows: with GLU gate and up rows interleaved, BLOCK_N / 2 features a block (the bf16 gemv's)
    offs_n, n_ok = _w_block_rows(pid_n, N, BLOCK_N, GLU)
    w_rows = W_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    s_rows = S_ptr + offs_n.to(tl.int64)[:, None] * stride_sn
    z_rows = Z_ptr + offs_n.to(tl.int64)[:, None] * stride_sn
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    KW = K // P  # words per row
    k_start = k_lo
    if PRE:
        # The words are not written by the previous kernel (the weights), so the first step's are requested
        # before the programmatic-launch wait: their latency passes under that kernel (module doc of
        # kiln.kernels._common.pdl_prologue); x, which it writes, is read after the wait
        wcol0 = k_lo // P + tl.arange(0, BLOCK_W)
        w0_ok = n_ok[:, None] & (wcol0 < KW)[None, :]
        w0 = tl.load(w_rows + wcol0[None, :], mask=w0_ok, other=0)
        k_start = k_lo + BLOCK_K
        _fma_wait(PDL, GLU)
    # Every tensor is (BLOCK_N, BLOCK_W) words or (BLOCK_W,) x values: a word's P values are taken apart
    # by masks in the thread that loaded it, and x's column 8j + i (4j + i) reaches that thread as the
    # i-th piece of x split in registers (tl.split of its contiguous (BLOCK_W, P) load): no dimension of
    # size P that the compiler could spread across threads. (P loads of x strided into the words' column
    # layout instead compiled to one 2-byte load per weight: Triton sank them past the row broadcast.)
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    if PRE:  # the preloaded step first (k_hi > k_lo: a split is never empty), then the loop the rest
        acc = _fma_step(acc, w0, k_lo, X_ptr, stride_xk, K, s_rows, z_rows, n_ok, w0_ok, wcol0, BITS, GROUP,
                        HAS_ZERO, BLOCK_K, ASM, X_PAIRS)  # fmt: skip
    for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
        wcol = k0 // P + tl.arange(0, BLOCK_W)  # (BLOCK_W,) word columns of this step
        w_ok = n_ok[:, None] & (wcol < KW)[None, :]
        w = tl.load(w_rows + wcol[None, :], mask=w_ok, other=0)  # (BLOCK_N, BLOCK_W) int32
        acc = _fma_step(acc, w, k0, X_ptr, stride_xk, K, s_rows, z_rows, n_ok, w_ok, wcol, BITS, GROUP, HAS_ZERO,
                        BLOCK_K, ASM, X_PAIRS)  # fmt: skip
    y = tl.sum(acc, axis=1)  # (BLOCK_N,)
    if BITS == 8:
        y = y * tl.load(S_ptr + offs_n.to(tl.int64) * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
    row0 = tl.zeros((1, 1), dtype=tl.int32)  # the one row
    if GLU:  # the unfused store's rounding of gate and up, then kiln.kernels.swiglu's: the same bits
        offs_f = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        _swiglu_epilogue(y[None, :], row0, offs_n[None, :], n_ok[None, :], offs_f[None, :], Y_ptr, Bias_ptr, M,
                         N // 2, HAS_BIAS, 1)  # fmt: skip
        if PDL:
            gdc_launch_dependents()
    else:
        _store(y[None, :], row0, offs_n[None, :], pid_k, Y_ptr, Bias_ptr, M, N, HAS_BIAS, "none", SPLIT_K)


@triton.jit
def _fma_wait(PDL: tl.constexpr, SIGNAL_END: tl.constexpr):
    """The fma kernel's programmatic-launch wait; it lets the next kernel be scheduled right after it, or with
    SIGNAL_END once its output is stored (the SwiGLU epilogue's: the down projection after it then starts
    as it did after the separate SwiGLU kernel)."""
    if SIGNAL_END:
        if PDL:
            gdc_wait()
    else:
        pdl_prologue(PDL)


@triton.jit
def _fma_step(acc, w, k0, X_ptr, stride_xk, K, s_rows, z_rows, n_ok, w_ok, wcol, BITS: tl.constexpr,
              GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
              X_PAIRS: tl.constexpr):  # fmt: skip
    """acc (BLOCK_N, BLOCK_W) plus one K step of the fma form: the step's words w (BLOCK_N, BLOCK_W) int32 at
    word columns wcol (w_ok: which exist), times x's BLOCK_K columns from k0, int4 scaled per group (int8's
    per-channel scale comes once, after the loop)."""
    P: tl.constexpr = 32 // BITS
    BLOCK_W: tl.constexpr = BLOCK_K // P
    # int4: a K step inside one group takes one scale (and zero point) per row, not one per word; a step of
    # two whole groups takes two per row, each word picking its own with a select
    ROW_SCALE: tl.constexpr = BITS == 4 and GROUP % BLOCK_K == 0
    TWO_GROUPS: tl.constexpr = BITS == 4 and BLOCK_K == 2 * GROUP
    if X_PAIRS:
        # x's columns 2m and 2m + 1 as the int32 m; a bf16 is the upper half of its float32, so each
        # becomes a float32 by one shift or one AND (Triton's conversion took a PRMT and an IMAD, for
        # every row a thread holds)
        offs_p = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        xp = tl.load(X_ptr.to(tl.pointer_type(tl.int32)) + offs_p, mask=offs_p < K // 2, other=0)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xx = tl.load(X_ptr + offs_k * stride_xk, mask=offs_k < K, other=0.0).to(tl.float32)
    if BITS == 4:
        if X_PAIRS:  # (BLOCK_W, 2, 2) pairs: pair 2b + c of word j at [j, b, c]
            e, o = tl.split(xp.reshape(BLOCK_W, 2, 2))  # pairs 0, 2 | 1, 3
            e0, e1 = tl.split(e)
            o0, o1 = tl.split(o)
            x0, x1 = _pair_lo(e0), _pair_hi(e0)
            x2, x3 = _pair_lo(o0), _pair_hi(o0)
            x4, x5 = _pair_lo(e1), _pair_hi(e1)
            x6, x7 = _pair_lo(o1), _pair_hi(o1)
        else:
            # (BLOCK_W, 2, 2, 2): column 8j + 4a + 2b + c at [j, a, b, c]; each split takes the last axis
            e, o = tl.split(xx.reshape(BLOCK_W, 2, 2, 2))  # c = 0, 1
            e0, e1 = tl.split(e)  # b = 0, 1
            o0, o1 = tl.split(o)
            x0, x4 = tl.split(e0)
            x2, x6 = tl.split(e1)
            x1, x5 = tl.split(o0)
            x3, x7 = tl.split(o1)
        if ROW_SCALE or TWO_GROUPS:  # (BLOCK_N, 1): the step's (first) group, one scale a row
            g = tl.full((1, 1), 0, tl.int32) + k0 // GROUP
            g_ok = n_ok[:, None]
            ws = tl.load(s_rows + g, mask=g_ok, other=0.0).to(tl.float32)
            if TWO_GROUPS:  # and the second group's, each word selecting its own
                second = (tl.arange(0, BLOCK_W) >= GROUP // 8)[None, :]  # (1, BLOCK_W)
                g2_ok = g_ok & (k0 + GROUP < K)  # a last step past K has no second group
                ws = tl.where(second, tl.load(s_rows + g + 1, mask=g2_ok, other=0.0).to(tl.float32), ws)
        else:  # (1, BLOCK_W): the group of each word (a word never spans two groups)
            g = (wcol // (GROUP // 8))[None, :]
            g_ok = w_ok
            ws = tl.load(s_rows + g, mask=g_ok, other=0.0).to(tl.float32)
        # nibbles 0-4 read in place; 5-7 (bits 20-31: bit 23 is past the mantissa) from w >> 12, where
        # they sit at nibble positions 2-4
        # (the arithmetic shift's sign bits land above bit 19, outside every mask)
        h = w >> 12
        if HAS_ZERO:  # off_p = 2**(23 - 4p) + z, exact; z from its bits as 2**23 + z - 2**23
            z = tl.load(z_rows + g, mask=g_ok, other=0).to(tl.int32)
            if TWO_GROUPS:
                z = tl.where(second, tl.load(z_rows + g + 1, mask=g2_ok, other=0).to(tl.int32), z)
            zf = (z | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            c0, c1, c2, c3, c4 = zf + 8388608.0, zf + 524288.0, zf + 32768.0, zf + 2048.0, zf + 128.0
        else:  # off_p = 2**(23 - 4p) + 8: constants
            c0, c1, c2, c3, c4 = 8388616.0, 524296.0, 32776.0, 2056.0, 136.0
        # one product added at a time, so that each is one FMA (pairs of products cost a multiply,
        # an FMA and an add per two)
        t = _nibble_times_x(w, 0, c0, x0, ASM)
        t += _nibble_times_x(w, 1, c1, x1, ASM)
        t += _nibble_times_x(w, 2, c2, x2, ASM)
        t += _nibble_times_x(w, 3, c3, x3, ASM)
        t += _nibble_times_x(w, 4, c4, x4, ASM)
        t += _nibble_times_x(h, 2, c2, x5, ASM)
        t += _nibble_times_x(h, 3, c3, x6, ASM)
        t += _nibble_times_x(h, 4, c4, x7, ASM)
        acc += t * ws  # one multiply per word: its group's scale
    else:
        if X_PAIRS:  # (BLOCK_W, 2) pairs: columns 4j + 2a, 4j + 2a + 1 at [j, a]
            a0, a1 = tl.split(xp.reshape(BLOCK_W, 2))
            x0, x1, x2, x3 = _pair_lo(a0), _pair_hi(a0), _pair_lo(a1), _pair_hi(a1)
        else:
            e, o = tl.split(xx.reshape(BLOCK_W, 2, 2))  # column 4j + 2a + b at [j, a, b]
            x0, x2 = tl.split(e)
            x1, x3 = tl.split(o)
        # bytes shifted down (ptxas makes an extraction and its OR one PRMT; bytes OR-ed in place under
        # their exponents, as the nibbles are, took 6.9 SASS instructions a weight at 8 x 256, this 6.4)
        acc += _int8_times_x(w, 0, x0)
        acc += _int8_times_x(w, 1, x1)
        acc += _int8_times_x(w, 2, x2)
        acc += _int8_times_x(w, 3, x3)  # the per-channel scale is applied once, at the end
    return acc


@triton.jit
def _int8_byte(w, i: tl.constexpr, MAGIC: tl.constexpr, SH: tl.constexpr, OUT: tl.constexpr):
    """Byte i of every word of w as q exactly in OUT's dtype. u = q + 128 in [0, 256) has 8 bits, one more
    than bf16 holds at 128's place, so it goes in two nibbles: (128 + hi) - 136 = hi - 8 and (128 + lo)
    - 128 = lo, then (hi - 8) * 16 + lo = u - 128 = q, an integer in [-128, 127]: exact at each step."""
    u = ((w >> (8 * i)) & 255) ^ 128
    hi = _magic_128(u >> 4, MAGIC, SH, OUT) - _magic_128(tl.full(u.shape, 8, tl.int32), MAGIC, SH, OUT)
    lo = _magic_128(u & 15, MAGIC, SH, OUT) - _magic_128(tl.zeros(u.shape, tl.int32), MAGIC, SH, OUT)
    return hi * 16.0 + lo


@triton.jit
def _wq_mma_kernel(
    X_ptr,  # (M, K) activations, M <= 16: x[m, k] at X_ptr + m * stride_xm + k * stride_xk
    W_ptr,  # int32 words (N, K / P) of int4 (P = 8) or int8 (P = 4) weights (module docstring), row stride stride_wn
    S_ptr,  # (N, K / GROUP) scales, row stride stride_sn
    Z_ptr,  # uint8 (N, K / GROUP) zero points, read when HAS_ZERO
    Y_ptr,  # (M, N) contiguous output; with SPLIT_K > 1 a float32 (SPLIT_K, M, N) partial-sum buffer
    Bias_ptr,  # (N,), read when HAS_BIAS (and SPLIT_K == 1)
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_sn,
    k_split,  # K range of one split: a multiple of BLOCK_K (K when SPLIT_K == 1)
    BITS: tl.constexpr,  # 4 or 8
    GROUP: tl.constexpr,  # int4 group size (int8: unused)
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MAGIC: tl.constexpr,  # bits of 128.0 in x's dtype (module docstring)
    SH: tl.constexpr,  # shift putting an integer at the units place of that float
    PRECISION: tl.constexpr,  # tl.dot input_precision ("ieee" for float32 activations)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # int4: divides GROUP, one group per K step
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kiln.kernels._common.pdl)
    ASM: tl.constexpr = False,  # int4 with 16-bit x: each byte's nibbles by one PRMT + LOP3 (not interpreted)
):
    pdl_prologue(PDL)
    P: tl.constexpr = 32 // BITS  # values per word
    BLOCK_W: tl.constexpr = BLOCK_K // P
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    n_ok = offs_n < N
    w_rows = W_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    s_rows = S_ptr + offs_n.to(tl.int64) * stride_sn  # (BLOCK_N,)
    z_rows = Z_ptr + offs_n.to(tl.int64) * stride_sn
    x_cols = X_ptr + offs_m[None, :] * stride_xm  # (1, 16): x.T's columns
    m_ok = (offs_m < M)[None, :]
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    KW = K // P
    xdt: tl.constexpr = X_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        wcol = k0 // P + tl.arange(0, BLOCK_W)
        w = tl.load(w_rows + wcol[None, :], mask=n_ok[:, None] & (wcol < KW)[None, :], other=0)  # (BN, BW)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_cols + offs_k[:, None] * stride_xk, mask=m_ok & (offs_k < K)[:, None], other=0.0)
        if BITS == 8:
            # bytes as exact integers in x's dtype, joined to (BLOCK_N, BLOCK_W, 2, 2): [n, j, a, b] = byte
            # 2a + b of word j, column 4j + 2a + b; the per-channel scale waits for the end
            b0 = _int8_byte(w, 0, MAGIC, SH, xdt)
            b1 = _int8_byte(w, 1, MAGIC, SH, xdt)
            b2 = _int8_byte(w, 2, MAGIC, SH, xdt)
            b3 = _int8_byte(w, 3, MAGIC, SH, xdt)
            wq = tl.join(tl.join(b0, b2), tl.join(b1, b3)).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(wq, xt, acc, input_precision=PRECISION)
        else:
            acc += _int4_group_dot(
                w, xt, s_rows, z_rows, n_ok, k0, GROUP, HAS_ZERO, MAGIC, SH, PRECISION, xdt, ASM
            )
    if BITS == 8:
        acc *= tl.load(s_rows, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    # written as it lies, (n, m) -> C[m, n]
    _store(acc, offs_m[None, :], offs_n[:, None], pid_k, Y_ptr, Bias_ptr, M, N, HAS_BIAS, "none", SPLIT_K)


@triton.jit
def _int4_group_dot(w, xt, s_rows, z_rows, n_ok, k0, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                    MAGIC: tl.constexpr, SH: tl.constexpr, PRECISION: tl.constexpr, xdt: tl.constexpr,
                    ASM: tl.constexpr):  # fmt: skip
    """One K step of int4 words w (BLOCK_N, BLOCK_W) inside one group: (q - z) @ xt (BLOCK_K, 16) in
    float32, times the group's scale per row."""
    BLOCK_N: tl.constexpr = w.shape[0]
    g = k0 // GROUP
    s = tl.load(s_rows + g, mask=n_ok, other=0.0).to(tl.float32)  # (BLOCK_N,)
    if HAS_ZERO:
        z = tl.load(z_rows + g, mask=n_ok, other=0).to(tl.int32)
    else:
        z = tl.full((BLOCK_N,), 8, tl.int32)
    c = _magic_128(z, MAGIC, SH, xdt)[:, None]  # (BLOCK_N, 1): 128 + z
    if xdt.primitive_bitwidth == 16:
        wq = _int4_tile_by_bytes(w, c, MAGIC, SH, xdt, ASM)
    else:
        wq = _int4_tile_by_nibbles(w, c, MAGIC, SH, xdt)
    part = tl.dot(wq, xt, input_precision=PRECISION)  # (BLOCK_N, 16) over one group's columns
    return part * s[:, None]


@triton.jit
def _byte_nibbles(w, i: tl.constexpr, MAGIC: tl.constexpr, SH: tl.constexpr, ASM: tl.constexpr):
    """Byte i of every word of w as one int32 holding two 16-bit floats of x's dtype: 128 + its low nibble
    (bits 0-15) and 128 + its high nibble (bits 16-31). ASM: one PRMT (byte i of w << SH into byte 0, byte
    i of w >> (4 - SH) into byte 2) and one LOP3 (the two nibbles' bits, OR the two magics), with the
    selector, mask and magic in registers hoisted out of the loop; the interpreter takes shifts and masks,
    the same bits."""
    mask: tl.constexpr = (15 << SH) | (15 << (16 + SH))
    magic2: tl.constexpr = MAGIC | (MAGIC << 16)
    if ASM:
        sel = tl.full(w.shape, i | (i << 4) | ((4 + i) << 8) | ((4 + i) << 12), tl.int32)
        m = tl.full(w.shape, mask, tl.int32)
        e = tl.full(w.shape, magic2, tl.int32)  # 0x43004300 or 0x58005800: below 2**31
        p = tl.inline_asm_elementwise(
            "{ .reg .b32 t; prmt.b32 t, $1, $2, $3; lop3.b32 $0, t, $4, $5, 0xea; }",
            "=r,r,r,r,r,r",
            [w << SH, w >> (4 - SH), sel, m, e],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        lo = ((w >> (8 * i)) & 15) << SH
        hi = ((w >> (8 * i + 4)) & 15) << (16 + SH)
        p = lo | hi | magic2
    return p


@triton.jit
def _int4_tile_by_bytes(w, c, MAGIC: tl.constexpr, SH: tl.constexpr, xdt: tl.constexpr, ASM: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) tile of q - z in x's 16-bit dtype, a byte (two adjacent columns) at a time:
    each byte's pair of 16-bit floats comes out of one PRMT + LOP3 already side by side in one register,
    which is where the tile's layout keeps two adjacent K columns, so the tile needs no repacking; the
    subtraction of 128 + z then runs on both halves (packed HADD2). Exact: small integers."""
    BLOCK_N: tl.constexpr = w.shape[0]
    BLOCK_K: tl.constexpr = w.shape[1] * 8
    p0 = _byte_nibbles(w, 0, MAGIC, SH, ASM)
    p1 = _byte_nibbles(w, 1, MAGIC, SH, ASM)
    p2 = _byte_nibbles(w, 2, MAGIC, SH, ASM)
    p3 = _byte_nibbles(w, 3, MAGIC, SH, ASM)
    # (BLOCK_N, BLOCK_W, 2, 2) of the bytes' low (even) and high (odd) nibbles: [n, j, s, t] = byte 2s + t
    lo0, lo1, lo2, lo3 = _half(p0, 0, xdt), _half(p1, 0, xdt), _half(p2, 0, xdt), _half(p3, 0, xdt)
    hi0, hi1, hi2, hi3 = _half(p0, 1, xdt), _half(p1, 1, xdt), _half(p2, 1, xdt), _half(p3, 1, xdt)
    even = tl.join(tl.join(lo0, lo2), tl.join(lo1, lo3))
    odd = tl.join(tl.join(hi0, hi2), tl.join(hi1, hi3))
    # [n, j, s, t, u] = nibble 2 (2s + t) + u = column 8j + 4s + 2t + u: the natural column order
    return (tl.join(even, odd) - c[:, :, None, None, None]).reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _half(p, h: tl.constexpr, xdt: tl.constexpr):
    """The 16-bit float in half h (0: bits 0-15, 1: bits 16-31) of each int32 p, in xdt."""
    if h == 1:
        p = p >> 16
    return p.to(tl.int16).to(xdt, bitcast=True)


@triton.jit
def _int4_tile_by_nibbles(w, c, MAGIC: tl.constexpr, SH: tl.constexpr, xdt: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) tile of q - z in x's dtype (float32 x: 32-bit values, one per register), a
    nibble at a time."""
    BLOCK_N: tl.constexpr = w.shape[0]
    BLOCK_K: tl.constexpr = w.shape[1] * 8
    # nibble i of each word as q - z = (128 + q) - (128 + z), exact, in x's dtype: (BLOCK_N, BLOCK_W)
    n0 = _magic_128(w & 15, MAGIC, SH, xdt) - c
    n1 = _magic_128((w >> 4) & 15, MAGIC, SH, xdt) - c
    n2 = _magic_128((w >> 8) & 15, MAGIC, SH, xdt) - c
    n3 = _magic_128((w >> 12) & 15, MAGIC, SH, xdt) - c
    n4 = _magic_128((w >> 16) & 15, MAGIC, SH, xdt) - c
    n5 = _magic_128((w >> 20) & 15, MAGIC, SH, xdt) - c
    n6 = _magic_128((w >> 24) & 15, MAGIC, SH, xdt) - c
    n7 = _magic_128((w >> 28) & 15, MAGIC, SH, xdt) - c
    # joined in registers to (BLOCK_N, BLOCK_W, 2, 2, 2): [n, j, a, b, c] = nibble 4a + 2b + c of word j,
    # i.e. column 8j + 4a + 2b + c: the reshape is the natural column order
    even = tl.join(tl.join(n0, n4), tl.join(n2, n6))
    odd = tl.join(tl.join(n1, n5), tl.join(n3, n7))
    return tl.join(even, odd).reshape(BLOCK_N, BLOCK_K)


def word_view(qweight: torch.Tensor) -> torch.Tensor | None:
    """qweight (N, B) uint8/int8 seen as int32 words (N, B / 4), or None where its rows are not whole,
    4-byte aligned words (the fma/mma forms then cannot take it)."""
    if qweight.shape[1] % 4 or qweight.stride(1) != 1 or qweight.stride(0) % 4 or qweight.data_ptr() % 4:
        return None
    return qweight.view(torch.int32)
