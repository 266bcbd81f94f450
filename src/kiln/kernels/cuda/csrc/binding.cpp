// The torch binding: each function takes tensors, checks what the C launchers cannot see, and calls the
// launcher on the current CUDA stream of the tensors' device. Users call the Python wrappers in
// kiln.kernels.cuda (they validate shapes and dtypes with KilnError); these checks are the backstop.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "api.h"

namespace {

void check(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void* stream_of(const at::Tensor& t) {
    return static_cast<void*>(c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
}

void ok(const char* err) { TORCH_CHECK(err == nullptr, "kiln CUDA kernel: ", err ? err : ""); }

const float* cf(const at::Tensor& t) { return static_cast<const float*>(t.data_ptr()); }
float* f(const at::Tensor& t) { return static_cast<float*>(t.data_ptr()); }

void vector_add(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int64_t variant) {
    check(a, "a"), check(b, "b"), check(out, "out");
    c10::cuda::CUDAGuard guard(a.device());
    ok(kiln_vector_add((int)variant, cf(a), cf(b), f(out), a.numel(), stream_of(a)));
}

void strided_read(const at::Tensor& x, const at::Tensor& out, int64_t n, int64_t stride, int64_t grid) {
    check(x, "x"), check(out, "out");
    TORCH_CHECK(n * stride <= x.numel() && grid * 256 <= out.numel(), "strided_read: buffers too small");
    c10::cuda::CUDAGuard guard(x.device());
    ok(kiln_strided_read(cf(x), f(out), n, (int)stride, (int)grid, stream_of(x)));
}

void smem_bank(const at::Tensor& out, int64_t stride, int64_t grid, int64_t iters) {
    check(out, "out");
    TORCH_CHECK(grid * 256 <= out.numel(), "smem_bank: out too small");
    c10::cuda::CUDAGuard guard(out.device());
    ok(kiln_smem_bank((int)stride, f(out), (int)grid, (int)iters, stream_of(out)));
}

void pointer_chase(const at::Tensor& next, int64_t warm, int64_t iters, const at::Tensor& cycles,
                   const at::Tensor& sink) {
    check(next, "next"), check(cycles, "cycles"), check(sink, "sink");
    c10::cuda::CUDAGuard guard(next.device());
    ok(kiln_pointer_chase(static_cast<const uint32_t*>(next.data_ptr()), warm, iters,
                          static_cast<long long*>(cycles.data_ptr()), static_cast<uint32_t*>(sink.data_ptr()),
                          stream_of(next)));
}

std::vector<int64_t> occupancy_ballast() {
    std::vector<int64_t> r;
    for (int v = 0; v < kiln_occupancy_variants(); ++v) r.push_back(kiln_occupancy_ballast(v));
    return r;
}

void occupancy_read(int64_t variant, const at::Tensor& x, const at::Tensor& out, int64_t grid) {
    check(x, "x"), check(out, "out");
    TORCH_CHECK(grid * 256 <= out.numel() && x.numel() % 4 == 0, "occupancy_read: bad buffers");
    c10::cuda::CUDAGuard guard(x.device());
    ok(kiln_occupancy_read((int)variant, cf(x), f(out), x.numel() / 4, (int)grid, stream_of(x)));
}

std::tuple<int64_t, int64_t, int64_t> occupancy_info(int64_t variant) {
    int regs = 0, local = 0, blocks = 0;
    ok(kiln_occupancy_info((int)variant, &regs, &local, &blocks));
    return {regs, local, blocks};
}

void sgemm(int64_t step, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    check(a, "a"), check(b, "b"), check(c, "c");
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(1) == b.size(0) && c.size(0) == a.size(0) &&
                    c.size(1) == b.size(1),
                "sgemm: shapes must be (M, K) @ (K, N) -> (M, N)");
    c10::cuda::CUDAGuard guard(a.device());
    ok(kiln_sgemm((int)step, (int)a.size(0), (int)b.size(1), (int)a.size(1), cf(a), cf(b), f(c), stream_of(a)));
}

void sgemm_warptile(int64_t config, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    check(a, "a"), check(b, "b"), check(c, "c");
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(1) == b.size(0) && c.size(0) == a.size(0) &&
                    c.size(1) == b.size(1),
                "sgemm_warptile: shapes must be (M, K) @ (K, N) -> (M, N)");
    c10::cuda::CUDAGuard guard(a.device());
    ok(kiln_sgemm_warptile((int)config, (int)a.size(0), (int)b.size(1), (int)a.size(1), cf(a), cf(b), f(c),
                           stream_of(a)));
}

void sgemm_double_buffered(int64_t config, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    check(a, "a"), check(b, "b"), check(c, "c");
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(1) == b.size(0) && c.size(0) == a.size(0) &&
                    c.size(1) == b.size(1),
                "sgemm_double_buffered: shapes must be (M, K) @ (K, N) -> (M, N)");
    c10::cuda::CUDAGuard guard(a.device());
    ok(kiln_sgemm_double_buffered((int)config, (int)a.size(0), (int)b.size(1), (int)a.size(1), cf(a), cf(b), f(c),
                                  stream_of(a)));
}

void sgemm_skewed(int64_t config, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    check(a, "a"), check(b, "b"), check(c, "c");
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(1) == b.size(0) && c.size(0) == a.size(0) &&
                    c.size(1) == b.size(1),
                "sgemm_skewed: shapes must be (M, K) @ (K, N) -> (M, N)");
    c10::cuda::CUDAGuard guard(a.device());
    ok(kiln_sgemm_skewed((int)config, (int)a.size(0), (int)b.size(1), (int)a.size(1), cf(a), cf(b), f(c),
                         stream_of(a)));
}

void mma_bf16(int64_t config, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    check(a, "a"), check(b, "b"), check(c, "c");
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(1) == b.size(0) && c.size(0) == a.size(0) &&
                    c.size(1) == b.size(1),
                "mma_bf16: shapes must be (M, K) @ (K, N) -> (M, N)");
    c10::cuda::CUDAGuard guard(a.device());
    ok(kiln_mma_bf16((int)config, (int)a.size(0), (int)b.size(1), (int)a.size(1), a.data_ptr(), b.data_ptr(), c.data_ptr(),
                     stream_of(a)));
}

void mma_peak(int64_t iters, int64_t grid, const at::Tensor& out) {
    check(out, "out");
    TORCH_CHECK(out.scalar_type() == at::kFloat && grid * 256 <= out.numel(),
                "mma_peak: out must hold grid * 256 floats");
    c10::cuda::CUDAGuard guard(out.device());
    ok(kiln_mma_peak((int)iters, (int)grid, f(out), stream_of(out)));
}

void mma_fp8(const at::Tensor& a, const at::Tensor& bt, const at::Tensor& scale_a, const at::Tensor& scale_b,
             const at::Tensor& c) {
    check(a, "a"), check(bt, "bt"), check(scale_a, "scale_a"), check(scale_b, "scale_b"), check(c, "c");
    TORCH_CHECK(a.dim() == 2 && bt.dim() == 2 && c.dim() == 2 && a.size(1) == bt.size(1) && c.size(0) == a.size(0) &&
                    c.size(1) == bt.size(0),
                "mma_fp8: shapes must be (M, K) @ (N, K)^T -> (M, N)");
    c10::cuda::CUDAGuard guard(a.device());
    ok(kiln_mma_fp8((int)a.size(0), (int)bt.size(0), (int)a.size(1), a.data_ptr(), bt.data_ptr(),
                    static_cast<const float*>(scale_a.data_ptr()), static_cast<const float*>(scale_b.data_ptr()),
                    c.data_ptr(), stream_of(a)));
}

void wgmma_bf16(int64_t config, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& c) {
    check(a, "a"), check(bt, "bt"), check(c, "c");
    TORCH_CHECK(a.dim() == 2 && bt.dim() == 2 && c.dim() == 2 && a.size(1) == bt.size(1) && c.size(0) == a.size(0) &&
                    c.size(1) == bt.size(0),
                "wgmma_bf16: shapes must be (M, K) @ (N, K)^T -> (M, N)");
    c10::cuda::CUDAGuard guard(a.device());
    ok(kiln_wgmma_bf16((int)config, (int)a.size(0), (int)bt.size(0), (int)a.size(1), a.data_ptr(), bt.data_ptr(),
                       c.data_ptr(), stream_of(a)));
}

void wgmma_fp8(int64_t config, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& scale_a,
               const at::Tensor& scale_b, const at::Tensor& c) {
    check(a, "a"), check(bt, "bt"), check(scale_a, "scale_a"), check(scale_b, "scale_b"), check(c, "c");
    TORCH_CHECK(a.dim() == 2 && bt.dim() == 2 && c.dim() == 2 && a.size(1) == bt.size(1) && c.size(0) == a.size(0) &&
                    c.size(1) == bt.size(0),
                "wgmma_fp8: shapes must be (M, K) @ (N, K)^T -> (M, N)");
    c10::cuda::CUDAGuard guard(a.device());
    ok(kiln_wgmma_fp8((int)config, (int)a.size(0), (int)bt.size(0), (int)a.size(1), a.data_ptr(), bt.data_ptr(),
                      static_cast<const float*>(scale_a.data_ptr()), static_cast<const float*>(scale_b.data_ptr()),
                      c.data_ptr(), stream_of(a)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "kiln's CUDA C++ kernels (kiln.kernels.cuda)";
    m.def("vector_add", &vector_add);
    m.def("strided_read", &strided_read);
    m.def("smem_bank", &smem_bank);
    m.def("pointer_chase", &pointer_chase);
    m.def("occupancy_ballast", &occupancy_ballast);
    m.def("occupancy_read", &occupancy_read);
    m.def("occupancy_info", &occupancy_info);
    m.def("sgemm_steps", &kiln_sgemm_steps);
    m.def("sgemm", &sgemm);
    m.def("sgemm_warptile_configs", &kiln_sgemm_warptile_configs);
    m.def("sgemm_warptile", &sgemm_warptile);
    m.def("sgemm_double_buffered", &sgemm_double_buffered);
    m.def("sgemm_skewed_configs", &kiln_sgemm_skewed_configs);
    m.def("sgemm_skewed", &sgemm_skewed);
    m.def("mma_configs", &kiln_mma_configs);
    m.def("mma_bf16", &mma_bf16);
    m.def("mma_fp8", &mma_fp8);
    m.def("mma_peak_chains", &kiln_mma_peak_chains);
    m.def("mma_peak", &mma_peak);
    m.def("wgmma_configs", &kiln_wgmma_configs);
    m.def("wgmma_bf16", &wgmma_bf16);
    m.def("wgmma_fp8", &wgmma_fp8);
}
