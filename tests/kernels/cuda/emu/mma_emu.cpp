// The tensor-core kernels (csrc/mma_kernels.cuh, with the cp.async kernel's dynamic shared memory made a
// static array and the TMA kernel's pointed at emu_smem by the test) under the host emulation, bf16 at
// every configuration of KILN_MMA_CONFIGS (the TMA ones with their tensor maps) and e4m3 at the one it
// launches, against an fp32 product of the same values: partial tiles in M,
// N and K, several K tiles (the stage ring wraps), bf16 and e4m3. Small integers are exact in both
// formats and in every partial sum, so results compare exactly after the same bf16 rounding.
#include "hopper_emu.h"  // mbarriers, TMA and named barriers for gemm_tma; includes ptx_emu.h
#include "mma_kernels_emu.cuh"

static unsigned cdiv(int a, int b) { return (a + b - 1) / b; }

static uint8_t to_e4m3(float v) {
    for (int b = 0; b < 256; ++b)
        if (((b >> 3) & 15) != 15 && emu::e4m3(b) == v) return b;
    abort();
}

int main() {
    // one block with every edge partial and 7 (bf16) or 4 (e4m3) K tiles through a 3-stage ring; four blocks;
    // and for the persistent configurations only (the emulation is slow), 3 x 2 tiles of 128 x 128 (3 x 1 of
    // 128 x 256, 2 x 2 of 256 x 128) with partial edges and 3 or 2 K tiles, which their blocks take 2 at a
    // time: the K-tile stream crosses from one tile into the next mid-ring
    const int shapes[][3] = {{40, 72, 400}, {136, 136, 16}, {264, 136, 144}};
    int bad = 0;
    for (const auto& s : shapes) {
        const int M = s[0], N = s[1], K = s[2];
        const bool persistent_only = &s == &shapes[2];
        // the TMA-fed kernel (3 warpgroups of std::threads a block, slow to emulate) runs every configuration
        // on the first shape (its stage ring wraps, every edge partial) and its 128 x 128 tile on the second
        // (several blocks)
        const bool first = &s == &shapes[0];
        std::vector<float> Af(M * K), Bf(K * N);
        srand(3);
        for (auto& x : Af) x = rand() % 9 - 4;
        for (auto& x : Bf) x = rand() % 7 - 3;
        std::vector<float> R(M * N, 0.f);
        for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j)
                for (int k = 0; k < K; ++k) R[i * N + j] += Af[i * K + k] * Bf[k * N + j];

        std::vector<__nv_bfloat16> A(M * K), B(K * N), C(M * N);
        for (int i = 0; i < M * K; ++i) A[i].x = emu_f2bf(Af[i]);
        for (int i = 0; i < K * N; ++i) B[i].x = emu_f2bf(Bf[i]);
        for (auto& c : C) c.x = 0x7fc0;  // NaN: an element never written fails
        const auto* a8 = reinterpret_cast<const unsigned char*>(A.data());
        const auto* b8 = reinterpret_cast<const unsigned char*>(B.data());
#define X(CFG, BM, BN, WARPS_M, WARPS_N, STAGES, PIPE, KB, EPI, PERSIST, TMA)                                 \
    if ((PERSIST || !persistent_only) && (!TMA || first || BM * BN <= 128 * 128)) {                          \
        for (auto& c : C) c.x = 0x7fc0; /* NaN: an element never written fails */                         \
        /* persistent: about half the tiles' blocks, so that blocks loop over 2 or more tiles */           \
        const unsigned tiles = cdiv(M, BM) * cdiv(N, BN);                                                   \
        if constexpr (TMA) {                                                                                \
            /* A: M rows of K in boxes of BM rows; B: K rows of N in boxes of 64 rows (64 columns) */       \
            const CUtensorMap ta{a8, {(uint64_t)K, (uint64_t)M}, (uint64_t)K * 2, {64, BM}, 2};             \
            const CUtensorMap tb{b8, {(uint64_t)N, (uint64_t)K}, (uint64_t)N * 2, {64, 64}, 2};             \
            emu_launch(dim3(tiles), dim3(WARPS_M * WARPS_N * 32 + 128), [&] {                               \
                mma_gemm::gemm_tma<BM, BN, WARPS_M, WARPS_N, STAGES, 1>(ta, tb, M, N, K, C.data());         \
            });                                                                                             \
        } else {                                                                                            \
            emu_launch(dim3(PERSIST ? (tiles + 1) / 2 : tiles), dim3(WARPS_M * WARPS_N * 32), [&] {         \
                mma_gemm::gemm<false, BM, BN, WARPS_M, WARPS_N, STAGES, PIPE, KB, EPI, PERSIST>(            \
                    M, N, K, a8, b8, nullptr, nullptr, C.data());                                           \
            });                                                                                             \
        }                                                                                                   \
        int wrong = 0;                                                                                      \
        for (int i = 0; i < M * N; ++i) wrong += emu::bf16(C[i].x) != emu::bf16(emu_f2bf(R[i]));           \
        printf("bf16 config %d %dx%dx%d: %d wrong\n", CFG, M, N, K, wrong);                                 \
        bad += wrong != 0;                                                                                  \
    }
        KILN_MMA_CONFIGS(X)
#undef X
        if (persistent_only) continue;

        std::vector<uint8_t> A8(M * K), Bt8(N * K);
        for (int i = 0; i < M * K; ++i) A8[i] = to_e4m3(Af[i]);
        for (int n = 0; n < N; ++n)
            for (int k = 0; k < K; ++k) Bt8[n * K + k] = to_e4m3(Bf[k * N + n]);
        const float sa = 0.5f, sb = 0.25f;
        for (auto& c : C) c.x = 0x7fc0;
        emu_launch(dim3(cdiv(M, 128) * cdiv(N, 128)), dim3(256),
                   [&] { mma_gemm::gemm<true, 128, 128, 2, 4, 3, false>(M, N, K, A8.data(), Bt8.data(), &sa, &sb, C.data()); });
        int wrong = 0;
        for (int i = 0; i < M * N; ++i) wrong += emu::bf16(C[i].x) != emu::bf16(emu_f2bf(R[i] * sa * sb));
        printf("fp8 %dx%dx%d: %d wrong\n", M, N, K, wrong);
        bad += wrong != 0;
    }
    return bad != 0;
}
