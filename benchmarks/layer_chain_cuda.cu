// bench_layer_chain.py's "barriers" and "stream" designs written by hand in CUDA C++ (same data
// flow, same weights, same outputs): does the Triton and Gluon kernels' code, rather than the chain
// itself, cost time? (docs/benchmarks.md, session 36)
//
// barriers: one block of 256 threads per multiprocessor. Per phase: arrive at the grid barrier
// (thread 0, release), issue the phase's weight rows into registers, wait (thread 0 polls with
// acquire loads), load the input vector from L2, dot products (warp w owns rows 2w and 2w+1 of each
// 16-row chunk; lane l columns l*8 + k*256 .. +8, k < 4), store.
#include <cuda_bf16.h>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

namespace {

constexpr int kCols = 1024;
constexpr int kChunks = 9;  // chunks per program per layer: 2 + 1 + 1 + 3 + 2

constexpr int kLine = 32;  // counters 128 bytes apart: each on its own L2 line

// The grid barrier's count spread over kCounters counters (program p counts at p % kCounters), so
// that arrivals do not queue at one L2 atomic unit; thread t < kCounters waits on counter t.
template <int kCounters>
__device__ __forceinline__ void arrive(unsigned* bar) {
  __syncthreads();  // every thread's stores of the phase precede the arrival
  if (threadIdx.x == 0) {
    unsigned* counter = bar + (blockIdx.x % kCounters) * kLine;
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
  }
}

// Wait until phase ``phases`` (counting from 1) has every program's arrival.
template <int kCounters>
__device__ __forceinline__ void wait_for(const unsigned* bar, unsigned phases) {
  const int t = threadIdx.x;
  if (t < kCounters) {
    const int programs = gridDim.x;
    const unsigned target = phases * (programs / kCounters + (t < programs % kCounters ? 1 : 0));
    const unsigned* counter = bar + t * kLine;
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}

template <bool kEvictFirst>
__device__ __forceinline__ uint4 load_weights(const uint4* p) {
  if constexpr (kEvictFirst) {
    return __ldcs(p);  // streaming: evicted first
  } else {
    return __ldg(p);
  }
}

// The lane's 32 input values (columns lane*8 + k*256 .. +8, k < 4), from L2.
__device__ __forceinline__ void load_input(const float* X, int lane, float (&x)[4][8]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float4 a = __ldcg(reinterpret_cast<const float4*>(X + lane * 8 + k * 256));
    const float4 b = __ldcg(reinterpret_cast<const float4*>(X + lane * 8 + k * 256 + 4));
    x[k][0] = a.x; x[k][1] = a.y; x[k][2] = a.z; x[k][3] = a.w;
    x[k][4] = b.x; x[k][5] = b.y; x[k][6] = b.z; x[k][7] = b.w;
  }
}

// A row's dot product: the lane's four 16-byte pieces of the row (8 bf16 each) against its inputs,
// summed over the warp (every lane gets the sum).
__device__ __forceinline__ float row_dot(const uint4 (&w)[4], const float (&x)[4][8]) {
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w[k]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(h[e]);
      acc = fmaf(f.x, x[k][2 * e], acc);
      acc = fmaf(f.y, x[k][2 * e + 1], acc);
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  return acc;
}

template <int C, bool kEvictFirst, int kCounters>
__device__ __forceinline__ void phase(const __nv_bfloat16* W, const float* X, float* out, unsigned* bar, int layer,
                                      int ph, int j0, int programs, int pid) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  arrive<kCounters>(bar);
  uint4 w[C][2][4];
  const long row0 = (static_cast<long>(layer * kChunks + j0) * programs + pid) * 16;
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const long row = row0 + static_cast<long>(c) * programs * 16 + 2 * warp + i;
        w[c][i][k] = load_weights<kEvictFirst>(reinterpret_cast<const uint4*>(W + row * kCols + lane * 8 + k * 256));
      }
  wait_for<kCounters>(bar, static_cast<unsigned>(layer * 5 + ph + 1));
  float x[4][8];
  load_input(X, lane, x);
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float acc = row_dot(w[c][i], x);
      if (lane == 0) out[pid * 16 * C + c * 16 + 2 * warp + i] = acc;
    }
}

template <bool kEvictFirst, int kCounters>
__global__ void __launch_bounds__(256, 1)
    barriers_kernel(const __nv_bfloat16* W, float* buf, unsigned* bar, int layers, int stride) {
  const int pid = blockIdx.x, programs = gridDim.x;
  for (int layer = 0; layer < layers; ++layer) {
    phase<2, kEvictFirst, kCounters>(W, buf + 4 * stride, buf + 0 * stride, bar, layer, 0, 0, programs, pid);
    phase<1, kEvictFirst, kCounters>(W, buf + 0 * stride, buf + 1 * stride, bar, layer, 1, 2, programs, pid);
    phase<1, kEvictFirst, kCounters>(W, buf + 1 * stride, buf + 2 * stride, bar, layer, 2, 3, programs, pid);
    phase<3, kEvictFirst, kCounters>(W, buf + 2 * stride, buf + 3 * stride, bar, layer, 3, 4, programs, pid);
    phase<2, kEvictFirst, kCounters>(W, buf + 3 * stride, buf + 4 * stride, bar, layer, 4, 7, programs, pid);
  }
}

// ---- The stream in CUDA C++: a producer warp copies every chunk by cp.async.bulk into a ring of
// kSlots 32 KB shared-memory slots (L2 evict-first), eight consumer warps run the barrier, the input
// load and the dots from shared memory (bench_layer_chain.py's Gluon "stream", without Gluon).

constexpr int kSlots = 6;
constexpr int kChunkBytes = 16 * kCols * 2;
constexpr int kConsumers = 256;
constexpr int kPieces = 4;  // copies per chunk (8 KB each)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n LAB_WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra LAB_WAIT;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

template <int C, bool kBarriers>
__device__ __forceinline__ int stream_phase(const unsigned char* ring, unsigned full0, unsigned empty0, const float* X,
                                            float* out, unsigned* bar, int layer, int ph, int i, int pid) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if constexpr (kBarriers) {
    consumers_sync();
    if (threadIdx.x == 0) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar) : "memory");
      const unsigned target = static_cast<unsigned>((layer * 5 + ph + 1) * gridDim.x);
      unsigned seen;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(bar) : "memory");
      } while (seen < target);
    }
    consumers_sync();
  }
  float x[4][8];
  load_input(X, lane, x);
#pragma unroll
  for (int c = 0; c < C; ++c, ++i) {
    const int slot = i % kSlots;
    mbar_wait(full0 + slot * 8, (i / kSlots) & 1);
    const unsigned char* chunk = ring + slot * kChunkBytes;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 2 * warp + r;
      uint4 w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        w[k] = *reinterpret_cast<const uint4*>(chunk + (row * kCols + lane * 8 + k * 256) * 2);
      const float acc = row_dot(w, x);
      if (lane == 0) out[pid * 16 * C + c * 16 + row] = acc;
    }
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty0 + slot * 8) : "memory");
  }
  return i;
}

template <bool kBarriers>
__global__ void __launch_bounds__(kConsumers + 32, 1)
    stream_kernel(const __nv_bfloat16* W, float* buf, unsigned* bar, int layers, int stride) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem;
  const unsigned full0 = smem_addr(smem + kSlots * kChunkBytes);
  const unsigned empty0 = full0 + kSlots * 8;
  const int pid = blockIdx.x, programs = gridDim.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(full0 + s * 8));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 8;" ::"r"(empty0 + s * 8));  // one per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers) {  // the producer warp: one thread issues every copy
    if (threadIdx.x == kConsumers) {
      unsigned long long policy;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
      int i = 0;
      for (int layer = 0; layer < layers; ++layer)
        for (int j = 0; j < kChunks; ++j, ++i) {
          const int slot = i % kSlots;
          mbar_wait(empty0 + slot * 8, ((i / kSlots) & 1) ^ 1);
          const unsigned full = full0 + slot * 8;
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full), "r"(kChunkBytes)
                       : "memory");
          const long row0 = (static_cast<long>(layer * kChunks + j) * programs + pid) * 16;
          for (int piece = 0; piece < kPieces; ++piece)  // several copies in flight per chunk
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                " [%0], [%1], %2, [%3], %4;" ::"r"(smem_addr(ring + slot * kChunkBytes + piece * (kChunkBytes / kPieces))),
                "l"(W + row0 * kCols + piece * (kChunkBytes / kPieces / 2)), "r"(kChunkBytes / kPieces), "r"(full),
                "l"(policy)
                : "memory");
        }
    }
    return;
  }
  int i = 0;
  for (int layer = 0; layer < layers; ++layer) {
    i = stream_phase<2, kBarriers>(ring, full0, empty0, buf + 4 * stride, buf + 0 * stride, bar, layer, 0, i, pid);
    i = stream_phase<1, kBarriers>(ring, full0, empty0, buf + 0 * stride, buf + 1 * stride, bar, layer, 1, i, pid);
    i = stream_phase<1, kBarriers>(ring, full0, empty0, buf + 1 * stride, buf + 2 * stride, bar, layer, 2, i, pid);
    i = stream_phase<3, kBarriers>(ring, full0, empty0, buf + 2 * stride, buf + 3 * stride, bar, layer, 3, i, pid);
    i = stream_phase<2, kBarriers>(ring, full0, empty0, buf + 3 * stride, buf + 4 * stride, bar, layer, 4, i, pid);
  }
}

}  // namespace

void launch_stream(const torch::Tensor& W, torch::Tensor& buf, torch::Tensor& bar, int64_t layers, int64_t programs,
                   int64_t stride, bool barriers) {
  TORCH_CHECK(W.is_cuda() && W.scalar_type() == torch::kBFloat16 && W.size(1) == kCols, "W: bf16 [rows, 1024] on CUDA");
  const int bytes = kSlots * kChunkBytes + 2 * kSlots * 8;
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto* w = reinterpret_cast<const __nv_bfloat16*>(W.data_ptr<at::BFloat16>());
  auto* b = reinterpret_cast<unsigned*>(bar.data_ptr<int>());
  if (barriers) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(stream_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    stream_kernel<true><<<programs, kConsumers + 32, bytes, stream>>>(w, buf.data_ptr<float>(), b, layers, stride);
  } else {
    C10_CUDA_CHECK(cudaFuncSetAttribute(stream_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    stream_kernel<false><<<programs, kConsumers + 32, bytes, stream>>>(w, buf.data_ptr<float>(), b, layers, stride);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int kCounters>
void launch_with(const __nv_bfloat16* w, float* buf, unsigned* bar, int layers, int programs, int stride,
                 bool evict_first, cudaStream_t stream) {
  if (evict_first) {
    barriers_kernel<true, kCounters><<<programs, 256, 0, stream>>>(w, buf, bar, layers, stride);
  } else {
    barriers_kernel<false, kCounters><<<programs, 256, 0, stream>>>(w, buf, bar, layers, stride);
  }
}

void launch(const torch::Tensor& W, torch::Tensor& buf, torch::Tensor& bar, int64_t layers, int64_t programs,
            int64_t stride, bool evict_first, int64_t counters) {
  TORCH_CHECK(W.is_cuda() && W.scalar_type() == torch::kBFloat16 && W.size(1) == kCols, "W: bf16 [rows, 1024] on CUDA");
  TORCH_CHECK(buf.scalar_type() == torch::kFloat32 && bar.scalar_type() == torch::kInt32, "buf float32, bar int32");
  TORCH_CHECK(bar.numel() >= counters * kLine, "bar: ", counters * kLine, " int32 for ", counters, " counters");
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto* w = reinterpret_cast<const __nv_bfloat16*>(W.data_ptr<at::BFloat16>());
  auto* b = reinterpret_cast<unsigned*>(bar.data_ptr<int>());
  float* out = buf.data_ptr<float>();
  switch (counters) {
    case 1: launch_with<1>(w, out, b, layers, programs, stride, evict_first, stream); break;
    case 4: launch_with<4>(w, out, b, layers, programs, stride, evict_first, stream); break;
    case 8: launch_with<8>(w, out, b, layers, programs, stride, evict_first, stream); break;
    case 16: launch_with<16>(w, out, b, layers, programs, stride, evict_first, stream); break;
    default: TORCH_CHECK(false, "counters: 1, 4, 8 or 16, not ", counters);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("launch", &launch, "the barriers design in CUDA C++");
  m.def("launch_stream", &launch_stream, "the stream design in CUDA C++");
}
