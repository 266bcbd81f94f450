// The Hopper wgmma + TMA GEMMs (csrc/wgmma_kernels.cuh, its dynamic shared memory pointed at emu_smem by
// the test) under the host emulation (hopper_emu.h), every configuration of KILN_WGMMA_CONFIGS, bf16 and
// e4m3, against a host product of integer-valued inputs: partial tiles in M, N and K and more K tiles
// than stages (the ring wraps). Small integers are exact in both formats and in every partial sum, so
// results compare exactly after the same bf16 rounding.
#include "hopper_emu.h"
#include "wgmma_kernels_emu.cuh"

static unsigned cdiv(int a, int b) { return (a + b - 1) / b; }

static uint8_t to_e4m3(float v) {
    for (int b = 0; b < 256; ++b)
        if (((b >> 3) & 15) != 15 && emu::e4m3(b) == v) return b;
    abort();
}

static CUtensorMap map_of(const void* base, int rows, int K, int elem, int box_rows) {
    return CUtensorMap{static_cast<const unsigned char*>(base), {(uint64_t)K, (uint64_t)rows}, (uint64_t)K * elem,
                       {(uint32_t)(128 / elem), (uint32_t)box_rows}, elem};
}

int main() {
    // (M, N, K): every edge partial for every tile size (BM 128/256, BN 128/256, K tiles of 64 bf16 or
    // 128 e4m3); 11 (bf16) or 6 (e4m3) K tiles: the stage ring of every configuration wraps
    const int shapes[][3] = {{136, 136, 656}};
    int bad = 0;
    for (const auto& s : shapes) {
        const int M = s[0], N = s[1], K = s[2];
        std::vector<float> Af(M * K), Bf(N * K);  // B as Bt (N, K)
        srand(5);
        for (auto& x : Af) x = rand() % 7 - 3;
        for (auto& x : Bf) x = rand() % 5 - 2;
        std::vector<float> R(M * N, 0.f);
        for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j)
                for (int k = 0; k < K; ++k) R[i * N + j] += Af[i * K + k] * Bf[j * K + k];
        std::vector<__nv_bfloat16> A(M * K), Bt(N * K), C(M * N);
        for (int i = 0; i < M * K; ++i) A[i].x = emu_f2bf(Af[i]);
        for (int i = 0; i < N * K; ++i) Bt[i].x = emu_f2bf(Bf[i]);
        std::vector<uint8_t> A8(M * K), Bt8(N * K);
        for (int i = 0; i < M * K; ++i) A8[i] = to_e4m3(Af[i]);
        for (int i = 0; i < N * K; ++i) Bt8[i] = to_e4m3(Bf[i]);
        const float sa = 0.5f, sb = 0.25f;
#define X(CFG, BM, BN, NC, STAGES)                                                                          \
    for (int fp8 = 0; fp8 < 2; ++fp8) {                                                                     \
        if (fp8 && K % 16) continue;                                                                        \
        for (auto& c : C) c.x = 0x7fc0; /* NaN: an element never written fails */                          \
        const CUtensorMap ta = fp8 ? map_of(A8.data(), M, K, 1, BM) : map_of(A.data(), M, K, 2, BM);        \
        const CUtensorMap tb = fp8 ? map_of(Bt8.data(), N, K, 1, BN) : map_of(Bt.data(), N, K, 2, BN);      \
        emu_launch(dim3(cdiv(M, BM) * cdiv(N, BN)), dim3((NC + 1) * 128), [&] {                             \
            if (fp8)                                                                                        \
                wgmma_gemm::gemm<true, BM, BN, NC, STAGES>(ta, tb, M, N, K, C.data(), &sa, &sb);            \
            else                                                                                            \
                wgmma_gemm::gemm<false, BM, BN, NC, STAGES>(ta, tb, M, N, K, C.data(), nullptr, nullptr);   \
        });                                                                                                 \
        int wrong = 0;                                                                                      \
        for (int i = 0; i < M * N; ++i)                                                                     \
            wrong += emu::bf16(C[i].x) != emu::bf16(emu_f2bf(fp8 ? R[i] * sa * sb : R[i]));                 \
        printf("%s config %d %dx%dx%d: %d wrong\n", fp8 ? "e4m3" : "bf16", CFG, M, N, K, wrong);          \
        bad += wrong != 0;                                                                                  \
    }
        KILN_WGMMA_CONFIGS(X)
#undef X
    }
    return bad != 0;
}
