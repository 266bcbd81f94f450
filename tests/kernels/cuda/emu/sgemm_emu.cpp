// The SGEMM ladder's kernels (csrc/sgemm_kernels.cuh) under the host emulation, against a double
// product, on odd shapes, with and without the 16-byte paths. Launch configurations as in csrc/sgemm.cu
// (the tables are sgemm_kernels.cuh's; the test makes the kernels' dynamic shared memory a static array).
// Integer-valued inputs make every partial sum exact, so the comparison is equality.
#include "cuda_emu.h"
#include "sgemm_kernels.cuh"

using namespace sgemm_ladder;

static unsigned cdiv(int a, int b) { return (a + b - 1) / b; }
static dim3 tiles(int M, int N, int BM, int BN) { return dim3(cdiv(N, BN), cdiv(M, BM)); }

static void run(int step, int M, int N, int K, const float* A, const float* B, float* C, bool vec) {
    const bool vA = vec && K % 4 == 0, vB = vec && N % 4 == 0, vC = vB;
    switch (step) {
        case 0: emu_launch(dim3(cdiv(M, 32), cdiv(N, 32)), dim3(32, 32), [&] { naive(M, N, K, A, B, C); }); break;
        case 1: emu_launch(tiles(M, N, 32, 32), dim3(1024), [&] { coalesced<32>(M, N, K, A, B, C); }); break;
        case 2: emu_launch(tiles(M, N, 32, 32), dim3(1024), [&] { smem_tiled<32>(M, N, K, A, B, C); }); break;
        case 3: emu_launch(tiles(M, N, 64, 64), dim3(512), [&] { blocktile_1d<64, 64, 8, 8>(M, N, K, A, B, C); }); break;
        case 4: emu_launch(tiles(M, N, 128, 128), dim3(256), [&] { blocktile_2d<128, 128, 8, 8, 8>(M, N, K, A, B, C); }); break;
        case 5: emu_launch(tiles(M, N, 128, 128), dim3(256), [&] { vectorized<128, 128, 8, 8, 8>(M, N, K, A, B, C, vA, vB, vC); }); break;
        case 6: emu_launch(tiles(M, N, 128, 128), dim3(128), [&] { warptiled<128, 128, 16, 64, 64, 4, 8, 4, 128>(M, N, K, A, B, C, vA, vB, vC); }); break;
        // the other warp-tile configurations of kiln_sgemm_warptile (csrc/sgemm.cu)
        case 7: emu_launch(tiles(M, N, 128, 128), dim3(256), [&] { warptiled<128, 128, 16, 64, 32, 2, 8, 4, 256>(M, N, K, A, B, C, vA, vB, vC); }); break;
        case 8: emu_launch(tiles(M, N, 64, 128), dim3(128), [&] { warptiled<64, 128, 16, 32, 64, 2, 8, 4, 128>(M, N, K, A, B, C, vA, vB, vC); }); break;
        case 9: emu_launch(tiles(M, N, 128, 128), dim3(128), [&] { warptiled<128, 128, 8, 64, 64, 4, 8, 4, 128>(M, N, K, A, B, C, vA, vB, vC); }); break;
        case 10: emu_launch(tiles(M, N, 128, 128), dim3(256), [&] { warptiled<128, 128, 8, 64, 32, 2, 8, 4, 256>(M, N, K, A, B, C, vA, vB, vC); }); break;
        // the double-buffered kernel (step 7 runs config 1) at every configuration
#define X(i, BM, BN, BK, WM, WN, WNITER, TM, TN, NT)                                                        \
        case 11 + i: emu_launch(tiles(M, N, BM, BN), dim3(NT), [&] {                                       \
            double_buffered<BM, BN, BK, WM, WN, WNITER, TM, TN, NT, 1>(M, N, K, A, B, C, vA, vB, vC); }); break;
        KILN_WARPTILE_CONFIGS(X)
#undef X
        // the skewed kernel (kiln_sgemm_skewed) at every configuration
#define X(i, BM, BN, BK, WM, WN, WNITER, TM, TN, NT, MINB)                                                  \
        case 16 + i: emu_launch(tiles(M, N, BM, BN), dim3(NT), [&] {                                       \
            double_buffered<BM, BN, BK, WM, WN, WNITER, TM, TN, NT, MINB, true>(M, N, K, A, B, C, vA, vB, vC); }); break;
        KILN_SKEWED_CONFIGS(X)
#undef X
    }
}

int main() {
    const int shapes[][3] = {{37, 45, 13}, {130, 68, 36}};
    int bad = 0;
    for (const auto& s : shapes) {
        const int M = s[0], N = s[1], K = s[2];
        std::vector<float> A(M * K), B(K * N), R(M * N);
        srand(1);
        for (auto& x : A) x = rand() % 17 - 8;
        for (auto& x : B) x = rand() % 13 - 6;
        for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j) {
                double acc = 0;
                for (int k = 0; k < K; ++k) acc += A[i * K + k] * B[k * N + j];
                R[i * N + j] = acc;
            }
#define X(i, ...) +1
        constexpr int skewed = 0 KILN_SKEWED_CONFIGS(X);
#undef X
        for (int step = 0; step < 16 + skewed; ++step)
            for (int vec = 0; vec < (step >= 5 ? 2 : 1); ++vec) {
                std::vector<float> C(M * N, 12345.f);
                run(step, M, N, K, A.data(), B.data(), C.data(), vec);
                int wrong = 0;
                for (int i = 0; i < M * N; ++i) wrong += C[i] != R[i];
                printf("sgemm step %d vec %d %dx%dx%d: %d wrong\n", step, vec, M, N, K, wrong);
                bad += wrong != 0;
            }
    }
    return bad != 0;
}
