// The tensor-core kernels (csrc/mma_kernels.cuh, with its dynamic shared memory made a static array by
// the test) under the host emulation, against an fp32 product of the same values: partial tiles in M,
// N and K, several K tiles (the stage ring wraps), bf16 and e4m3. Small integers are exact in both
// formats and in every partial sum, so results compare exactly after the same bf16 rounding.
#include "ptx_emu.h"
#include "mma_kernels_emu.cuh"

static unsigned cdiv(int a, int b) { return (a + b - 1) / b; }

static uint8_t to_e4m3(float v) {
    for (int b = 0; b < 256; ++b)
        if (((b >> 3) & 15) != 15 && emu::e4m3(b) == v) return b;
    abort();
}

int main() {
    // one block with every edge partial and 7 (bf16) or 4 (e4m3) K tiles through a 3-stage ring; four blocks
    const int shapes[][3] = {{40, 72, 400}, {136, 136, 16}};
    int bad = 0;
    for (const auto& s : shapes) {
        const int M = s[0], N = s[1], K = s[2];
        std::vector<float> Af(M * K), Bf(K * N);
        srand(3);
        for (auto& x : Af) x = rand() % 9 - 4;
        for (auto& x : Bf) x = rand() % 7 - 3;
        std::vector<float> R(M * N, 0.f);
        for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j)
                for (int k = 0; k < K; ++k) R[i * N + j] += Af[i * K + k] * Bf[k * N + j];
        const dim3 grid(cdiv(N, mma_gemm::BN), cdiv(M, mma_gemm::BM));

        std::vector<__nv_bfloat16> A(M * K), B(K * N), C(M * N);
        for (int i = 0; i < M * K; ++i) A[i].x = emu_f2bf(Af[i]);
        for (int i = 0; i < K * N; ++i) B[i].x = emu_f2bf(Bf[i]);
        for (auto& c : C) c.x = 0x7fc0;  // NaN: an element never written fails
        emu_launch(grid, dim3(mma_gemm::THREADS), [&] { mma_gemm::bf16_gemm(M, N, K, A.data(), B.data(), C.data()); });
        int wrong = 0;
        for (int i = 0; i < M * N; ++i) wrong += emu::bf16(C[i].x) != emu::bf16(emu_f2bf(R[i]));
        printf("bf16 %dx%dx%d: %d wrong\n", M, N, K, wrong);
        bad += wrong != 0;

        std::vector<uint8_t> A8(M * K), Bt8(N * K);
        for (int i = 0; i < M * K; ++i) A8[i] = to_e4m3(Af[i]);
        for (int n = 0; n < N; ++n)
            for (int k = 0; k < K; ++k) Bt8[n * K + k] = to_e4m3(Bf[k * N + n]);
        const float sa = 0.5f, sb = 0.25f;
        for (auto& c : C) c.x = 0x7fc0;
        emu_launch(grid, dim3(mma_gemm::THREADS),
                   [&] { mma_gemm::fp8_gemm(M, N, K, A8.data(), Bt8.data(), &sa, &sb, C.data()); });
        wrong = 0;
        for (int i = 0; i < M * N; ++i) wrong += emu::bf16(C[i].x) != emu::bf16(emu_f2bf(R[i] * sa * sb));
        printf("fp8 %dx%dx%d: %d wrong\n", M, N, K, wrong);
        bad += wrong != 0;
    }
    return bad != 0;
}
