"""The SGEMM ladder: fp32 C = A @ B in eight kernels, each changing one thing about the step before it;
and the tile configurations the benchmark sweeps (warp-tiled SGEMM, Hopper wgmma).

The order here is the order of `kiln_sgemm`'s `step` argument in csrc/sgemm.cu (a GPU test checks the
two agree); docs/cuda.md explains each step at length. Tile sizes are those of the kernel's launch:
BM x BN is the block's tile of C, BK the slice of K staged per iteration, TM x TN a thread's results.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import KilnError


@dataclass(frozen=True)
class LadderStep:
    name: str  # what `sgemm(a, b, step=...)` and the benchmark call it
    threads: int  # per block
    tile: str  # the launch's tile sizes
    teaches: str  # the one change from the previous step, and why it pays


SGEMM_LADDER: tuple[LadderStep, ...] = (
    LadderStep("naive", 1024, "32x32 threads, 1 result each",
               "one thread per C element; a warp spans 32 rows, so its A and C accesses are uncoalesced"),
    LadderStep("coalesced", 1024, "32x32, 1 result each",
               "a warp spans 32 columns of one row: B and C accesses become 128-byte transactions"),
    LadderStep("smem_tiled", 1024, "BM=BN=BK=32",
               "stage 32x32 tiles of A and B in shared memory: each global element loaded once per block"),
    LadderStep("blocktile_1d", 512, "BM=BN=64 BK=8 TM=8",
               "8 results per thread: one shared-memory B value feeds 8 FMAs"),
    LadderStep("blocktile_2d", 256, "BM=BN=128 BK=8 TM=TN=8",
               "an 8x8 register tile per thread: 64 FMAs per 16 shared loads (outer product)"),
    LadderStep("vectorized", 256, "BM=BN=128 BK=8 TM=TN=8, float4",
               "128-bit global and shared loads; A's tile stored transposed so its reads vectorize too"),
    LadderStep("warptiled", 128, "BM=BN=128 BK=16 WM=WN=64 (1x4 sub-tiles) TM=8 TN=4",
               "a warp-level tile: each warp's shared reads fall in few contiguous runs, registers reused"),
    LadderStep("double_buffered", 256, "BM=BN=128 BK=16 WM=64 WN=32 (1x2 sub-tiles) TM=8 TN=4, 2 buffers",
               "two shared buffers: the next tile's global loads fly during this tile's FMAs, one barrier"),
)  # fmt: skip


@dataclass(frozen=True)
class WarptileConfig:
    """One tile configuration of the warp-tiled kernel (step 6 runs the first) and of the double-buffered
    one (step 7 runs the second); the benchmark times them all on each shape and reports the fastest
    ("autotuned")."""

    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    wniter: int
    tm: int
    tn: int
    threads: int

    @property
    def name(self) -> str:
        return (
            f"{self.bm}x{self.bn}x{self.bk} warp {self.wm}x{self.wn}/{self.wniter} thread {self.tm}x{self.tn}"
        )


# The order of KILN_WARPTILE_CONFIGS in csrc/sgemm.cu (a CPU test compares the two).
WARPTILE_CONFIGS: tuple[WarptileConfig, ...] = (
    WarptileConfig(128, 128, 16, 64, 64, 4, 8, 4, 128),
    WarptileConfig(128, 128, 16, 64, 32, 2, 8, 4, 256),
    WarptileConfig(64, 128, 16, 32, 64, 2, 8, 4, 128),
    WarptileConfig(128, 128, 8, 64, 64, 4, 8, 4, 128),
    WarptileConfig(128, 128, 8, 64, 32, 2, 8, 4, 256),
)
# The configuration ladder step 7 (double_buffered) launches.
DOUBLE_BUFFERED_STEP_CONFIG = 1


@dataclass(frozen=True)
class SkewedConfig(WarptileConfig):
    """One tile configuration of the skewed kernel: the double-buffered kernel with the rows of A's
    transposed shared tile skewed so that its stores are conflict-free (`sgemm_skewed`), with
    `min_blocks` the blocks per SM its registers are held to (2 at 256 threads: <= 128 registers)."""

    min_blocks: int

    def __post_init__(self):
        # the kernel's static_asserts, checked here so that a bad row fails in a CPU test before nvcc
        warps = self.threads // 32
        wmiter = (self.wm * self.wn) // (32 * self.tm * self.tn * self.wniter)
        ok = (
            (self.bn // self.wn) * (self.bm // self.wm) == warps
            and wmiter >= 1
            and wmiter * 32 * self.tm * self.tn * self.wniter == self.wm * self.wn
            and self.bk in (8, 16, 32)
            and self.tm % 4 == 0
            and self.tn % 4 == 0
            and self.min_blocks in (1, 2)
        )
        # two buffers of B and of A plus A's skew: static up to 48 KiB, dynamic past it (<= 227 KiB)
        if not ok or self.smem_bytes > 227 * 1024:
            raise KilnError(f"bad skewed SGEMM config {self}: see KILN_SKEWED_CONFIGS in csrc/sgemm.cu")

    @property
    def smem_bytes(self) -> int:
        skew = (self.bk // 4 - 1) * (128 // self.bk)
        return 2 * 4 * (self.bk * self.bm + skew + self.bk * self.bn)

    @property
    def name(self) -> str:
        return f"{super().name} {self.threads}t {self.min_blocks}b/SM"


# The order of KILN_SKEWED_CONFIGS in csrc/sgemm.cu (a CPU test compares the two). Configs 0-7 timed on the
# H200 at 072ada3 (4 the fastest, 0.881x cuBLAS fp32): 0 is step 7's tile with the skew; 1 and 3 split a thread's 8 x 8 results into 2 x 2 sub-tiles
# of 4 x 4; 2 and 3 use BK = 8; 4 and 5 give each thread 128 results (8 x 16) in a 128 x 256 / 256 x 128 tile,
# 6 and 7 the same as 2 x 4 sub-tiles of 4 x 4.
SKEWED_CONFIGS: tuple[SkewedConfig, ...] = (
    SkewedConfig(128, 128, 16, 64, 32, 2, 8, 4, 256, 2),
    SkewedConfig(128, 128, 16, 64, 32, 2, 4, 4, 256, 2),
    SkewedConfig(128, 128, 8, 64, 32, 2, 8, 4, 256, 2),
    SkewedConfig(128, 128, 8, 64, 32, 2, 4, 4, 256, 2),
    SkewedConfig(128, 256, 8, 64, 64, 4, 8, 4, 256, 1),
    SkewedConfig(256, 128, 8, 64, 64, 4, 8, 4, 256, 1),
    SkewedConfig(128, 256, 8, 64, 64, 4, 4, 4, 256, 1),
    SkewedConfig(256, 128, 8, 64, 64, 4, 4, 4, 256, 1),
    # timed at 5f8741c (10 the fastest, 0.920x cuBLAS fp32): 8, 9 and 10 are 4, 5 and 6 at BK = 16 (half the barriers and loop
    # iterations per FMA; 49344 bytes of shared memory, so dynamic); 11 is 128 x 128 x 16 with one 8 x 8
    # tile per thread (TN = 8); 12 and 13 are config 4's thread tile (8 x 16) in 128 x 128 tiles of 4 warps,
    # two blocks per SM (251 / 225 registers), at BK = 16 and 8
    SkewedConfig(128, 256, 16, 64, 64, 4, 8, 4, 256, 1),
    SkewedConfig(256, 128, 16, 64, 64, 4, 8, 4, 256, 1),
    SkewedConfig(128, 256, 16, 64, 64, 4, 4, 4, 256, 1),
    SkewedConfig(128, 128, 16, 64, 32, 1, 8, 8, 256, 2),
    SkewedConfig(128, 128, 16, 64, 64, 4, 8, 4, 128, 2),
    SkewedConfig(128, 128, 8, 64, 64, 4, 8, 4, 128, 2),
)


def step_index(step: str | int) -> int:
    """The index of a ladder step given by name or index; KilnError naming the valid ones otherwise."""
    names = [s.name for s in SGEMM_LADDER]
    if isinstance(step, bool):  # bool is an int; True is not a step
        raise KilnError(
            f"unknown SGEMM step {step!r}; the steps are {', '.join(names)} (or 0..{len(names) - 1})"
        )
    if isinstance(step, int):
        if 0 <= step < len(names):
            return step
    elif step in names:
        return names.index(step)
    raise KilnError(f"unknown SGEMM step {step!r}; the steps are {', '.join(names)} (or 0..{len(names) - 1})")


@dataclass(frozen=True)
class MmaConfig:
    """One configuration of the mma.sync bf16 GEMM (csrc/mma_kernels.cuh): a BM x BN tile of C per block,
    warps_m x warps_n warps each owning (BM / warps_m) x (BN / warps_n) of it, `stages` K tiles of
    `k_bytes` bytes per row (128: 64 bf16; 256: 128 bf16) in flight (cp.async); `pipelined`: the warps'
    fragments double-buffered in registers (the next k16 step's ldmatrix issued before this step's mma);
    `smem_epilogue`: C stored through shared memory in 16-byte coalesced chunks; `persistent`: at most as
    many blocks as fit on the GPU at once, each looping over tiles, the cp.async copies of the next tile's
    first K tiles issued during this tile's last ones (stages laid out A-and-B contiguous, the C tile in
    the stage just read); `tma`: the warp-specialized kernel (gemm_tma), the stages filled by TMA from a
    producer warpgroup and handed over through mbarriers, no block-wide barrier in the main loop (Hopper
    only; register-pipelined, shared-memory epilogue, 128-byte K tiles; the consumer warps whole
    warpgroups)."""

    bm: int
    bn: int
    warps_m: int
    warps_n: int
    stages: int
    pipelined: bool = False
    k_bytes: int = 128
    smem_epilogue: bool = False
    persistent: bool = False
    tma: bool = False

    def __post_init__(self):
        wtm, wtn = self.bm // self.warps_m, self.bn // self.warps_n
        if wtm * self.warps_m != self.bm or wtn * self.warps_n != self.bn or wtm % 16 or wtn % 16:
            raise KilnError(f"bad mma config {self}: warp tiles must be whole multiples of 16 x 16")
        if self.smem_bytes > 227 * 1024 or self.stages < 2:
            raise KilnError(f"bad mma config {self}: {self.smem_bytes} bytes of shared memory, >= 2 stages")
        # the kernel's static_asserts: K tiles of 8 or 16 swizzled chunks per row; the C tile of the
        # shared-memory epilogue fits in the stages, and its rows have >= 8 chunks (the swizzle)
        if self.k_bytes not in (128, 256):
            raise KilnError(f"bad mma config {self}: k_bytes must be 128 or 256")
        if self.smem_epilogue and (self.bm * self.bn * 2 > self.smem_bytes or self.bn < 64):
            raise KilnError(f"bad mma config {self}: the C tile does not fit the epilogue's layout")
        # persistent: the register-pipelined shared-memory-epilogue kernel, the C tile inside one stage
        if self.persistent and (
            not (self.pipelined and self.smem_epilogue)
            or self.bm * self.bn * 2 > (self.bm + self.bn) * self.k_bytes
        ):
            raise KilnError(
                f"bad mma config {self}: persistent needs pipelined, smem_epilogue, C in one stage"
            )
        # TMA: the kernel's one form (its static_asserts): whole consumer warpgroups, 64-column B boxes,
        # boxes of <= 256 rows
        if self.tma and (
            not (self.pipelined and self.smem_epilogue) or self.persistent or self.k_bytes != 128
            or (self.warps_m * self.warps_n) % 4 or self.bn % 64 or self.bm > 256
        ):  # fmt: skip
            raise KilnError(
                f"bad mma config {self}: tma needs pipelined, smem_epilogue, 128-byte K tiles, whole "
                "warpgroups, BN % 64 == 0, BM <= 256, not persistent"
            )

    @property
    def threads(self) -> int:
        """Threads per block: the warps owning C, and with tma the producer warpgroup."""
        return 32 * self.warps_m * self.warps_n + (128 if self.tma else 0)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per block: the stages; with tma 1024 bytes of alignment slack and the
        two mbarriers per stage (RingSmem in csrc/tma_ring.cuh)."""
        stages = self.stages * (self.bm + self.bn) * self.k_bytes
        return stages + 1024 + 16 * self.stages if self.tma else stages

    @property
    def name(self) -> str:
        wtm, wtn = self.bm // self.warps_m, self.bn // self.warps_n
        pipe = " regpipe" if self.pipelined else ""
        kb = f" k{self.k_bytes // 2}" if self.k_bytes != 128 else ""
        epi = " smem-epilogue" if self.smem_epilogue else ""
        persist = " persistent" if self.persistent else ""
        tma = " tma warp-specialized" if self.tma else ""
        return (
            f"{self.bm}x{self.bn} warps {self.warps_m}x{self.warps_n} of {wtm}x{wtn} {self.stages}st{pipe}{kb}{epi}"
            f"{persist}{tma}"
        )


# The order of KILN_MMA_CONFIGS in csrc/mma_kernels.cuh (a CPU test compares the two); config 0 is the
# first version's geometry, and the one the FP8 mma.sync kernel runs.
MMA_CONFIGS: tuple[MmaConfig, ...] = (
    MmaConfig(128, 128, 2, 4, 3),
    MmaConfig(128, 256, 2, 4, 3),  # 64 x 64 warp tiles: 128 accumulators, half the ldmatrix per FLOP
    MmaConfig(128, 256, 2, 4, 4),
    MmaConfig(256, 128, 4, 2, 3),
    MmaConfig(128, 128, 2, 2, 4),
    # timed at 072ada3 (7 the fastest, 0.542x): the register-pipelined fragments on the best earlier tiles, and 128 x 128
    # tiles of 4 warps with 3 stages (96 KiB, <= 255 registers at 128 threads): two blocks per SM
    MmaConfig(128, 256, 2, 4, 4, pipelined=True),
    MmaConfig(256, 128, 4, 2, 4, pipelined=True),
    MmaConfig(128, 128, 2, 2, 3, pipelined=True),
    MmaConfig(128, 128, 2, 2, 3),
    # timed at 5f8741c (12 the fastest, 0.563x cuBLAS bf16): C through shared memory (16-byte coalesced stores) on configs 7, 5 and 6;
    # then K tiles of 256 bytes (128 bf16: half the barriers per FLOP) with 2 stages (192 KiB)
    MmaConfig(128, 128, 2, 2, 3, pipelined=True, smem_epilogue=True),
    MmaConfig(128, 256, 2, 4, 4, pipelined=True, smem_epilogue=True),
    MmaConfig(256, 128, 4, 2, 4, pipelined=True, smem_epilogue=True),
    MmaConfig(128, 256, 2, 4, 2, pipelined=True, k_bytes=256, smem_epilogue=True),
    MmaConfig(256, 128, 4, 2, 2, pipelined=True, k_bytes=256, smem_epilogue=True),
    # timed at 2cc8a3e (no gain; 9 the fastest, 0.572x): persistent grids (the next tile's first K tiles
    # copied during this tile's last ones and its epilogue) for configs 12, 9 and 13; and config 9's tile at
    # one block per SM with 3 stages of 256-byte K tiles (192 KiB; two blocks per SM would need 2 x 128 KiB)
    MmaConfig(128, 256, 2, 4, 2, pipelined=True, k_bytes=256, smem_epilogue=True, persistent=True),
    MmaConfig(128, 128, 2, 2, 3, pipelined=True, smem_epilogue=True, persistent=True),
    MmaConfig(256, 128, 4, 2, 2, pipelined=True, k_bytes=256, smem_epilogue=True, persistent=True),
    MmaConfig(128, 128, 2, 2, 3, pipelined=True, k_bytes=256, smem_epilogue=True),
    # not yet measured: the tiles of configs 10, 9 and 11 fed by TMA from a producer warpgroup (gemm_tma)
    MmaConfig(128, 256, 2, 4, 4, pipelined=True, smem_epilogue=True, tma=True),
    MmaConfig(128, 128, 2, 2, 3, pipelined=True, smem_epilogue=True, tma=True),
    MmaConfig(256, 128, 4, 2, 4, pipelined=True, smem_epilogue=True, tma=True),
)


def config_index(config: int, table: tuple, what: str) -> int:
    if isinstance(config, bool) or not isinstance(config, int) or not 0 <= config < len(table):
        raise KilnError(f"unknown {what} config {config!r}; choose 0..{len(table) - 1}")
    return config


@dataclass(frozen=True)
class WgmmaConfig:
    """One configuration of the Hopper wgmma + TMA GEMM (csrc/wgmma_kernels.cuh): a BM x BN tile of C per
    block, `consumers` warpgroups issuing wgmma (plus one producer warpgroup issuing TMA), `stages` K tiles
    of 128 bytes per row in flight."""

    bm: int
    bn: int
    consumers: int
    stages: int

    def __post_init__(self):
        # the kernel's static_asserts, checked here so a bad row fails in a CPU test before nvcc
        rows = self.bm // self.consumers
        if self.bn not in (128, 256) or rows % 64 or (rows // 64) * self.bn // 2 > 128:
            raise KilnError(f"bad wgmma config {self}: BN in (128, 256), 64-row slices, <= 128 accumulators")
        if self.smem_bytes > 227 * 1024 or self.stages < 2:
            raise KilnError(f"bad wgmma config {self}: {self.smem_bytes} bytes of shared memory, >= 2 stages")

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of a launch: the stages, the mbarriers and 1024 bytes of alignment slack."""
        return 1024 + self.stages * (self.bm + self.bn) * 128 + 2 * self.stages * 8

    @property
    def name(self) -> str:
        return f"{self.bm}x{self.bn} {self.consumers}cons {self.stages}st"


# The order of KILN_WGMMA_CONFIGS in csrc/wgmma_kernels.cuh (a CPU test compares the two).
WGMMA_CONFIGS: tuple[WgmmaConfig, ...] = (
    WgmmaConfig(128, 128, 1, 4),  # the simplest: one consumer warpgroup, two m64n128 slices
    WgmmaConfig(128, 256, 2, 4),  # two consumers of m64n256 each, setmaxnreg
    WgmmaConfig(128, 256, 2, 3),
    WgmmaConfig(256, 128, 2, 4),  # two consumers of 2 x m64n128 each
    WgmmaConfig(128, 128, 2, 5),
)
# What wgmma_bf16 / wgmma_fp8 run when no config is given (the benchmark reports the fastest).
WGMMA_DEFAULT = 1


def wgmma_config_index(config: int) -> int:
    return config_index(config, WGMMA_CONFIGS, "wgmma")
