// Row gather along dim 0: dst[m, :] = src[index[m], :] (torch.index_select(src, 0, index)).
//
// Invariant: every row of src is contiguous (W elements) but rows may sit `src_stride` apart,
// with src_stride >= W: the K and V slices of a fused QKV projection are such views, and
// gathering them here skips the .contiguous() copy index_select would otherwise need.
// One launch serves one tensor (gather_rows) or K and V together (gather_rows_pair,
// blockIdx.y picks the tensor). Rows move in the widest unit (16, 8, 4 bytes, else one
// element) that divides the row bytes, the row stride and both base pointers.
//
// NOTE: index values are NOT range-checked on the device (that would cost a sync or a flag
// read-back per call). An index outside [0, N) reads out of bounds: the caller guarantees range.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int kThreads = 256;      // threads per block (blockDim.x * blockDim.y)
constexpr int kRowsPerThread = 4;  // rows in flight per thread: 4 independent loads before stores

// One gather problem, byte pointers and sizes in units of the chosen copy width.
struct RowSpec {
  const char* src;
  char* dst;
  int64_t src_stride;  // units between consecutive source rows
  int64_t units;       // units per row
};

// Read-only loads through the non-coherent path where CUDA has an overload; plain otherwise
// (c10::Half / c10::BFloat16 in the scalar fallback).
template <typename Unit>
__device__ __forceinline__ Unit load_ro(const Unit* p) { return *p; }
template <>
__device__ __forceinline__ uint4 load_ro<uint4>(const uint4* p) { return __ldg(p); }
template <>
__device__ __forceinline__ uint2 load_ro<uint2>(const uint2* p) { return __ldg(p); }
template <>
__device__ __forceinline__ uint32_t load_ro<uint32_t>(const uint32_t* p) { return __ldg(p); }

// grid: (ceil(M / (blockDim.y * kRowsPerThread)), number of tensors); block: (bx, by).
template <typename Unit, typename Index>
__global__ void __launch_bounds__(kThreads)
gather_rows_kernel(const RowSpec a, const RowSpec b, const Index* __restrict__ index,
                   const int64_t m_rows) {
  const RowSpec s = blockIdx.y == 0 ? a : b;
  const Unit* __restrict__ src = reinterpret_cast<const Unit*>(s.src);
  Unit* __restrict__ dst = reinterpret_cast<Unit*>(s.dst);
  const int64_t row0 =
      (static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y) * kRowsPerThread;

  const Unit* src_row[kRowsPerThread];
  Unit* dst_row[kRowsPerThread];
  bool live[kRowsPerThread];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int64_t m = row0 + r;
    live[r] = m < m_rows;
    const int64_t n = live[r] ? static_cast<int64_t>(index[m]) : 0;
    src_row[r] = src + n * s.src_stride;
    dst_row[r] = dst + m * s.units;
  }
  for (int64_t c = threadIdx.x; c < s.units; c += blockDim.x) {
    Unit v[kRowsPerThread];
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      if (live[r]) v[r] = load_ro(src_row[r] + c);
    }
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      if (live[r]) dst_row[r][c] = v[r];
    }
  }
}

// NOTE: integers enter TORCH_CHECK messages as std::to_string / dims() strings, never through
// an ostream: on a torch 2.11 + CUDA 13 image, a message that streamed an int64 (the .so's own
// ostream::_M_insert<long>) crashed the process with SIGSEGV instead of raising RuntimeError.
// Strings, ScalarType and Device (formatted inside libc10) are safe. tests/test_kernels.py holds
// every message of this file to that rule.
std::string dims(at::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(a[i]);
  }
  return s + "]";
}

// Elements per row, after checking that the trailing dims of `t` form one contiguous block.
int64_t check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() >= 1, name, " must have at least one dimension");
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, name,
              " must be float32, float16 or bfloat16, got ", st);
  int64_t width = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    TORCH_CHECK(t.size(d) == 1 || t.stride(d) == width, name,
                " rows must be contiguous (trailing dims packed), got strides ", dims(t.strides()));
    width *= t.size(d);
  }
  TORCH_CHECK(t.size(0) <= 1 || t.stride(0) >= width, name, " row stride ", std::to_string(t.stride(0)),
              " is smaller than the row width ", std::to_string(width));
  return width;
}

void check_index(const at::Tensor& index, const at::Tensor& src) {
  TORCH_CHECK(index.device() == src.device(), "index must be on ", src.device(), ", got ",
              index.device());
  TORCH_CHECK(index.dim() == 1, "index must be 1-D, got ", std::to_string(index.dim()), "-D");
  TORCH_CHECK(index.scalar_type() == at::kInt || index.scalar_type() == at::kLong,
              "index must be int32 or int64, got ", index.scalar_type());
  TORCH_CHECK(index.is_contiguous(), "index must be contiguous");
  TORCH_CHECK(src.size(0) > 0 || index.numel() == 0, "gather from an empty source");
}

at::Tensor empty_out(const at::Tensor& src, int64_t m) {
  auto sizes = src.sizes().vec();
  sizes[0] = m;
  return at::empty(sizes, src.options().memory_format(at::MemoryFormat::Contiguous));
}

// Widest copy unit in bytes that divides every byte offset the kernel forms.
int unit_bytes(const at::Tensor& src, const at::Tensor& dst, int64_t width) {
  const int64_t esize = src.element_size();
  const int64_t row_bytes = width * esize;
  const int64_t stride_bytes = (src.size(0) > 1 ? src.stride(0) : width) * esize;
  const auto sp = reinterpret_cast<uintptr_t>(src.data_ptr());
  const auto dp = reinterpret_cast<uintptr_t>(dst.data_ptr());
  for (int w : {16, 8, 4}) {
    if (w > esize && row_bytes % w == 0 && stride_bytes % w == 0 && sp % w == 0 && dp % w == 0) {
      return w;
    }
  }
  return static_cast<int>(esize);
}

RowSpec make_spec(const at::Tensor& src, at::Tensor& dst, int64_t width, int unit) {
  const int64_t esize = src.element_size();
  const int64_t stride = src.size(0) > 1 ? src.stride(0) : width;
  return RowSpec{static_cast<const char*>(src.data_ptr()), static_cast<char*>(dst.data_ptr()),
                 stride * esize / unit, width * esize / unit};
}

template <typename Unit>
void launch_unit(const RowSpec& a, const RowSpec& b, int n_tensors, const at::Tensor& index) {
  const int64_t m = index.numel();
  const int64_t units = std::max(a.units, b.units);
  // blockDim.x covers one row's units (a warp at least), blockDim.y stacks rows.
  const int bx = static_cast<int>(std::min<int64_t>(kThreads, (units + 31) / 32 * 32));
  const int by = kThreads / bx;
  const int64_t rows_per_block = static_cast<int64_t>(by) * kRowsPerThread;
  const dim3 grid(static_cast<unsigned>((m + rows_per_block - 1) / rows_per_block), n_tensors);
  const dim3 block(bx, by);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "radixserve_gather_rows", [&] {
    gather_rows_kernel<Unit, index_t>
        <<<grid, block, 0, stream>>>(a, b, index.data_ptr<index_t>(), m);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Gathers srcs[i][index] into outs[i] (one or two tensors) with a single launch.
void launch(const std::vector<at::Tensor>& srcs, std::vector<at::Tensor>& outs,
            const std::vector<int64_t>& widths, const at::Tensor& index) {
  int unit = 16;
  for (size_t i = 0; i < srcs.size(); ++i) {
    unit = std::min(unit, unit_bytes(srcs[i], outs[i], widths[i]));
  }
  const RowSpec a = make_spec(srcs[0], outs[0], widths[0], unit);
  const RowSpec b = srcs.size() > 1 ? make_spec(srcs[1], outs[1], widths[1], unit) : a;
  const int n = static_cast<int>(srcs.size());
  switch (unit) {
    case 16: launch_unit<uint4>(a, b, n, index); break;
    case 8: launch_unit<uint2>(a, b, n, index); break;
    case 4: launch_unit<uint32_t>(a, b, n, index); break;
    default:
      // Scalar fallback: one element per access, typed by the source dtype.
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, srcs[0].scalar_type(),
                                      "radixserve_gather_rows_scalar", [&] {
        launch_unit<scalar_t>(a, b, n, index);
      });
  }
}

}  // namespace

at::Tensor gather_rows(const at::Tensor& src, const at::Tensor& index) {
  const int64_t width = check_rows(src, "src");
  check_index(index, src);
  at::Tensor out = empty_out(src, index.numel());
  if (index.numel() == 0 || width == 0) return out;
  const c10::cuda::CUDAGuard guard(src.device());
  std::vector<at::Tensor> outs{out};
  launch({src}, outs, {width}, index);
  return out;
}

std::vector<at::Tensor> gather_rows_pair(const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& index) {
  const int64_t wk = check_rows(k, "k");
  const int64_t wv = check_rows(v, "v");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v dtypes differ: ", k.scalar_type(),
              " vs ", v.scalar_type());
  TORCH_CHECK(k.device() == v.device(), "k and v devices differ");
  TORCH_CHECK(k.size(0) == v.size(0), "k and v row counts differ: ", std::to_string(k.size(0)), " vs ",
              std::to_string(v.size(0)));
  check_index(index, k);
  std::vector<at::Tensor> outs{empty_out(k, index.numel()), empty_out(v, index.numel())};
  if (index.numel() == 0 || (wk == 0 && wv == 0)) return outs;
  const c10::cuda::CUDAGuard guard(k.device());
  launch({k, v}, outs, {wk, wv}, index);
  return outs;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather_rows", &gather_rows, "dst[m] = src[index[m]] along dim 0 (strided rows ok)");
  m.def("gather_rows_pair", &gather_rows_pair, "K and V rows at the same index, one launch");
}
