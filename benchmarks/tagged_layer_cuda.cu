// bench_tagged_layer.py's design: session 38's capped, tagged stream (layer_chain_cuda.cu) laid out as
// a Qwen3-0.6B decoder layer at 1,024 cached rows: its bytes (35.7 MB a layer) and its six hand-offs.
//
// One block of 8 consumer warps and a producer warp per multiprocessor (P blocks, 128 <= P <= 256).
// Every weight matrix and the K/V cache are packed as 32 KB chunks (16 rows x 1,024 columns; a row
// of 2,048 or 3,072 columns spans 2 or 3 chunks), 1,088 a layer. The producer copies its block's
// chunks in the order the consumers use them into a ring of kSlots slots, with at most ``ahead``
// 8 KB copies requested and not yet landed. There is no barrier: every hand-off is a vector of
// tagged words (a bf16 value in the low half, the hand-off's 16-bit tag in the high half; attention's
// float32 partials as 64-bit words, value and 32-bit tag), polled until every tag is current.
//
// A layer (the norms without weights, no q/k norm or RoPE, the new token's K/V not attended: the
// data flow and the bytes, not the model):
//   A  every block: the residual h (polled; layer 0 reads h0), RMS-normalised; its q/k/v row chunks
//      (256 chunks, block a % P) -> hand-off 0: q/k/v (4,096 bf16 words)
//   B  128 blocks, one per (KV head, split of 64 cached rows): its head's 2 q rows, k and v (512
//      words of hand-off 0), one chunk of K and V rows; scores, softmax, P.V per query head
//      -> hand-off 1: the split's unnormalised output, max and sum (64-bit words)
//   M  16 blocks, one per query head: the head's 16 partials merged -> hand-off 2: attention (2,048)
//   C  64 blocks: 16 rows of the output projection (2 chunks each) plus h -> hand-off 3: h_mid
//   D  every block: h_mid normalised; gate and up row chunks in pairs (192 pairs, as ``pairs``
//      assigns them: up to 4 a block), silu(gate) * up -> hand-off 4: act (3,072)
//   E  64 blocks: 16 rows of the down projection (3 chunks each) plus h_mid -> hand-off 5: h
//      (and, unrounded, ``out``: what the check reads)
#include <cuda_bf16.h>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

#include "bulk_stream.cuh"

namespace {

using namespace bulk_stream;

constexpr int kCols = 1024;                 // a chunk's columns (and the hidden width)
constexpr int kChunkElems = 16 * kCols;     // 32 KB of bf16
constexpr int kChunkBytes = kChunkElems * 2;
constexpr int kPieces = 4;                  // 8 KB copies a chunk, each with its own mbarrier
constexpr int kSlots = 5;
constexpr int kConsumers = 256;
constexpr int kA = 256, kB = 128, kC = 128, kD = 384, kE = 192;  // chunks a layer, by phase
constexpr int kLayerChunks = kA + kB + kC + kD + kE;             // 1,088
constexpr int kB0 = kA, kC0 = kB0 + kB, kD0 = kC0 + kC, kE0 = kD0 + kD;
constexpr int kPart = 130;                  // a partial: 128 outputs, max, sum

// The global buffers of the hand-offs (u32 words unless noted).
struct Handoffs {
  unsigned* qkv;                 // 4,096
  unsigned long long* part;      // 128 tasks x 2 heads x kPart (64-bit words)
  unsigned* att;                 // 2,048
  unsigned* hmid;                // 1,024
  unsigned* act;                 // 3,072
  unsigned* h;                   // 1,024
};

// Shared memory besides the ring (floats).
struct Shared {
  float h[kCols], xn[kCols], att[2048], hmid[kCols], act[3072], qkv[512], part[16 * kPart];
  float scores[2][64], red[8], stats[2][2];
};

__device__ __forceinline__ unsigned tag_of(unsigned seq, int layers, int layer, int handoff) {
  return 1u + (seq * 6u * layers + layer * 6u + handoff) % 65535u;
}

__device__ __forceinline__ void hand_bf16(unsigned* X, int i, float v, unsigned tag) {
  store_word(X + i, tagged_word(v, tag));
}

__device__ __forceinline__ void hand_f32(unsigned long long* X, int i, float v, unsigned tag) {
  const unsigned long long word = (static_cast<unsigned long long>(tag) << 32) | __float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(X + i), "l"(word) : "memory");
}

// Poll n bf16 words of X (n a multiple of 4) until all carry ``tag``; their values to dst. The
// caller synchronises the consumers afterwards.
__device__ __forceinline__ void poll_bf16(const unsigned* X, int n, unsigned tag, float* dst) {
  for (int g = threadIdx.x; g < n / 4; g += kConsumers)
    *reinterpret_cast<float4*>(dst + 4 * g) = word_values(spin_for(X + 4 * g, tag));
}

// The same for n 64-bit words (n even; each 64-bit element of the vector load is read whole).
__device__ __forceinline__ void poll_f32(const unsigned long long* X, int n, unsigned tag, float* dst) {
  for (int g = threadIdx.x; g < n / 2; g += kConsumers) {
    unsigned long long a, b;
    unsigned spins = 0;
    do {
      asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(X + 2 * g) : "memory");
    } while (((a >> 32) != tag || (b >> 32) != tag) && ++spins < kSpinLimit);
    dst[2 * g] = __uint_as_float(static_cast<unsigned>(a));
    dst[2 * g + 1] = __uint_as_float(static_cast<unsigned>(b));
  }
}

// x[i] / rms(x) into xn (1,024 values). Thread t reads only x[4t, 4t + 4), which poll_bf16 of 1,024
// words leaves to it, so no barrier is needed before; the consumers synchronise inside.
__device__ __forceinline__ void normalise(const float* x, float* xn, float* red) {
  const int t = threadIdx.x;
  const float4 v = *reinterpret_cast<const float4*>(x + 4 * t);
  float s = v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
  if ((t & 31) == 0) red[t >> 5] = s;
  consumers_sync();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < 8; ++w) total += red[w];
  const float inv = rsqrtf(total / kCols + 1e-6f);
  *reinterpret_cast<float4*>(xn + 4 * t) = make_float4(v.x * inv, v.y * inv, v.z * inv, v.w * inv);
  consumers_sync();
}

// The ring, as the consumers see it.
struct Ring {
  const unsigned char* base;
  unsigned full0, empty0;
  int i;  // the next chunk

  __device__ __forceinline__ const unsigned char* wait(int piece) const {
    const int slot = i % kSlots;
    mbar_wait(full0 + (slot * kPieces + piece) * 8, (i / kSlots) & 1);
    return base + slot * kChunkBytes;
  }
  __device__ __forceinline__ const unsigned char* wait_all() const {
    const unsigned char* chunk = nullptr;
    for (int p = 0; p < kPieces; ++p) chunk = wait(p);
    return chunk;
  }
  __device__ __forceinline__ void release() {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(empty0 + (i % kSlots) * 8);
    ++i;
  }
};

// The warp's two rows (2w, 2w+1) of a 16-row block spanning NC chunks, against x (NC x 1,024 values
// in shared memory): every lane gets both sums.
template <int NC>
__device__ __forceinline__ void rows_dot(Ring& ring, const float* x, float (&acc)[2]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  acc[0] = acc[1] = 0.f;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const unsigned char* chunk = ring.wait(warp / 2);  // the copy that holds the warp's rows
    float xv[4][8];
    lane_slice(x + c * kCols, lane, xv);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      uint4 w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        w[k] = *reinterpret_cast<const uint4*>(chunk + ((2 * warp + r) * kCols + lane * 8 + k * 256) * 2);
      acc[r] += row_dot(w, xv);
    }
    ring.release();
  }
}

// Rows 16r .. 16r + 15 of a projection whose rows span NC chunks, against hand-off X (NC x 1,024
// words, polled into xs), each plus its row of ``residual``: handed on to XN (and, given ``out``,
// stored there unrounded).
template <int NC>
__device__ __forceinline__ void project_residual(Ring& ring, const unsigned* X, unsigned tag_in, float* xs,
                                                 const float* residual, unsigned* XN, unsigned tag_out, int r,
                                                 float* out) {
  poll_bf16(X, NC * kCols, tag_in, xs);
  consumers_sync();
  float acc[2];
  rows_dot<NC>(ring, xs, acc);
  const int row = 16 * r + 2 * (threadIdx.x >> 5);
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float v = residual[row + i] + acc[i];
      hand_bf16(XN, row + i, v, tag_out);
      if (out != nullptr) out[row + i] = v;
    }
}

// One (KV head, split) task: 64 cached rows of K and V (the chunk's rows 0-7 and 8-15) against the
// head's two query rows (sh.qkv[0, 256)); each query head's unnormalised output, max and sum go to
// hand-off 1.
__device__ __forceinline__ void attend(Ring& ring, Shared& sh, unsigned long long* part, int task, unsigned tag) {
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const unsigned char* chunk = ring.wait_all();
  const __nv_bfloat16* K = reinterpret_cast<const __nv_bfloat16*>(chunk);
  const __nv_bfloat16* V = K + 64 * 128;
  const float4 q0 = *reinterpret_cast<const float4*>(sh.qkv + lane * 4);
  const float4 q1 = *reinterpret_cast<const float4*>(sh.qkv + 128 + lane * 4);
  const float scale = rsqrtf(128.f);
#pragma unroll
  for (int j = 8 * warp; j < 8 * warp + 8; ++j) {
    const uint2 raw = *reinterpret_cast<const uint2*>(K + j * 128 + lane * 4);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    float s0 = q0.x * a.x + q0.y * a.y + q0.z * b.x + q0.w * b.y;
    float s1 = q1.x * a.x + q1.y * a.y + q1.z * b.x + q1.w * b.y;
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
      s0 += __shfl_xor_sync(0xffffffffu, s0, m);
      s1 += __shfl_xor_sync(0xffffffffu, s1, m);
    }
    if (lane == 0) {
      sh.scores[0][j] = s0 * scale;
      sh.scores[1][j] = s1 * scale;
    }
  }
  consumers_sync();
  if (warp < 2) {  // warp i: query head i's softmax over the 64 rows
    const float a = sh.scores[warp][lane], b = sh.scores[warp][lane + 32];
    float m = fmaxf(a, b);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
    const float pa = expf(a - m), pb = expf(b - m);
    float l = pa + pb;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) l += __shfl_xor_sync(0xffffffffu, l, d);
    sh.scores[warp][lane] = pa;
    sh.scores[warp][lane + 32] = pb;
    if (lane == 0) {
      sh.stats[warp][0] = m;
      sh.stats[warp][1] = l;
    }
  }
  consumers_sync();
  const int head = t >> 7, d = t & 127;
  float o = 0.f;
#pragma unroll 8
  for (int j = 0; j < 64; ++j) o = fmaf(sh.scores[head][j], __bfloat162float(V[j * 128 + d]), o);
  unsigned long long* dst = part + (task * 2 + head) * kPart;
  hand_f32(dst, d, o, tag);
  if (d < 2) hand_f32(dst, 128 + d, sh.stats[head][d], tag);
  ring.release();
}

__global__ void __launch_bounds__(kConsumers + 32, 1)
    tagged_layer_kernel(const __nv_bfloat16* W, const float* h0, Handoffs ho, float* out, const int* pairs,
                        unsigned seq, int layers, int ahead) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(16) Shared sh;
  const int b = blockIdx.x, P = gridDim.x;
  const unsigned full0 = smem_addr(smem + kSlots * kChunkBytes);
  const unsigned empty0 = full0 + kSlots * kPieces * 8;
  // This block's work: A chunks b, b + P, ...; B task P - 1 - b; merge b (< 16); C rows 16 * (b / 2)
  // for even b < 128; D pairs pairs[4b ..] (-1: no more); E rows 16 * (b / 2) for odd b < 128.
  const int task = P - 1 - b;
  int my_pairs[4], n_pairs = 0;
  for (int k = 0; k < 4 && pairs[4 * b + k] >= 0; ++k) my_pairs[n_pairs++] = pairs[4 * b + k];
  const bool has_b = task < kB, has_m = b < 16, has_c = b < 128 && b % 2 == 0, has_e = b < 128 && b % 2 == 1;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) {
      for (int p = 0; p < kPieces; ++p) mbar_init(full0 + (s * kPieces + p) * 8, 1);
      mbar_init(empty0 + s * 8, 8);  // one per consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers) {  // the producer: one thread copies the block's chunks in order
    if (threadIdx.x != kConsumers) return;
    const unsigned long long policy = evict_first_policy();
    int ids[16], n = 0;
    for (int a = b; a < kA; a += P) ids[n++] = a;
    if (has_b) ids[n++] = kB0 + task;
    if (has_c) ids[n++] = kC0 + b, ids[n++] = kC0 + b + 1;  // row chunk b / 2, both halves
    for (int k = 0; k < n_pairs; ++k)  // gate, then up
      ids[n++] = kD0 + 2 * my_pairs[k], ids[n++] = kD0 + 2 * my_pairs[k] + 1;
    if (has_e) {
      const int r = b / 2;
      ids[n++] = kE0 + 3 * r, ids[n++] = kE0 + 3 * r + 1, ids[n++] = kE0 + 3 * r + 2;
    }
    int i = 0;
    for (int layer = 0; layer < layers; ++layer)
      for (int k = 0; k < n; ++k, ++i) {
        const int slot = i % kSlots;
        mbar_wait(empty0 + slot * 8, ((i / kSlots) & 1) ^ 1);
        const __nv_bfloat16* src = W + (static_cast<long>(layer) * kLayerChunks + ids[k]) * kChunkElems;
        for (int p = 0; p < kPieces; ++p) {
          wait_landed<kSlots, kPieces>(full0, i * kPieces + p - ahead);  // at most ``ahead`` in flight
          const unsigned full = full0 + (slot * kPieces + p) * 8;
          expect_bytes(full, kChunkBytes / kPieces);
          bulk_copy(smem + slot * kChunkBytes + p * (kChunkBytes / kPieces), src + p * (kChunkElems / kPieces),
                    kChunkBytes / kPieces, full, policy);
        }
      }
    return;
  }
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  Ring ring{smem, full0, empty0, 0};
  float acc[2], acc2[2];
  for (int layer = 0; layer < layers; ++layer) {
    const auto tag = [&](int handoff) { return tag_of(seq, layers, layer, handoff); };
    // A: h, normalised; q/k/v rows
    if (layer == 0) {
      *reinterpret_cast<float4*>(sh.h + 4 * t) = *reinterpret_cast<const float4*>(h0 + 4 * t);
    } else {
      poll_bf16(ho.h, kCols, tag_of(seq, layers, layer - 1, 5), sh.h);
    }
    normalise(sh.h, sh.xn, sh.red);
    for (int a = b; a < kA; a += P) {
      rows_dot<1>(ring, sh.xn, acc);
      if (lane == 0)
#pragma unroll
        for (int r = 0; r < 2; ++r) hand_bf16(ho.qkv, 16 * a + 2 * warp + r, acc[r], tag(0));
    }
    // B: the head's q rows (and, as the real layer's dependency, its k and v rows)
    if (has_b) {
      const int head = task / 16;
      poll_bf16(ho.qkv + 256 * head, 256, tag(0), sh.qkv);
      poll_bf16(ho.qkv + 2048 + 128 * head, 128, tag(0), sh.qkv + 256);
      poll_bf16(ho.qkv + 3072 + 128 * head, 128, tag(0), sh.qkv + 384);
      consumers_sync();
      attend(ring, sh, ho.part, task, tag(1));
    }
    // M: query head b's 16 partials merged
    if (has_m) {
      const int kv = b / 2, q = b % 2;
      for (int s = 0; s < 16; ++s)
        poll_f32(ho.part + ((kv * 16 + s) * 2 + q) * kPart, kPart, tag(1), sh.part + s * kPart);
      consumers_sync();
      if (t < 128) {
        float m = -INFINITY;
        for (int s = 0; s < 16; ++s) m = fmaxf(m, sh.part[s * kPart + 128]);
        float o = 0.f, l = 0.f;
        for (int s = 0; s < 16; ++s) {
          const float w = expf(sh.part[s * kPart + 128] - m);
          o = fmaf(w, sh.part[s * kPart + t], o);
          l = fmaf(w, sh.part[s * kPart + 129], l);
        }
        hand_bf16(ho.att, 128 * b + t, o / l, tag(2));
      }
    }
    // C: 16 rows of the output projection, plus h
    if (has_c) project_residual<2>(ring, ho.att, tag(2), sh.att, sh.h, ho.hmid, tag(3), b / 2, nullptr);
    // D: h_mid normalised; gate and up rows, silu(gate) * up
    poll_bf16(ho.hmid, kCols, tag(3), sh.hmid);
    normalise(sh.hmid, sh.xn, sh.red);
    for (int k = 0; k < n_pairs; ++k) {
      const int j = my_pairs[k];
      rows_dot<1>(ring, sh.xn, acc);
      rows_dot<1>(ring, sh.xn, acc2);
      if (lane == 0)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float silu = acc[r] / (1.f + expf(-acc[r]));
          hand_bf16(ho.act, 16 * j + 2 * warp + r, silu * acc2[r], tag(4));
        }
    }
    // E: 16 rows of the down projection, plus h_mid
    if (has_e) project_residual<3>(ring, ho.act, tag(4), sh.act, sh.hmid, ho.h, tag(5), b / 2, out);
  }
}

}  // namespace

int64_t layer_chunks() { return kLayerChunks; }

// W: bf16 [layers * 1,088, 16, 1,024] (bench_tagged_layer.py packs it); h0: float32 [1,024]; words:
// int32 [>= 4096 + 2048 + 1024 + 3072 + 1024] (zeroed once); part: int64 [128 * 2 * 130]; out:
// float32 [1,024]; pairs: int32 [programs, 4], each block's gate/up pairs (-1: no more; every pair
// once); seq: new for each launch; ahead: 8 KB copies in flight a block, 1 to 20.
void launch(const torch::Tensor& W, const torch::Tensor& h0, torch::Tensor& words, torch::Tensor& part,
            torch::Tensor& out, const torch::Tensor& pairs, int64_t layers, int64_t programs, int64_t seq,
            int64_t ahead) {
  TORCH_CHECK(W.is_cuda() && W.scalar_type() == torch::kBFloat16 && W.numel() >= layers * kLayerChunks * kChunkElems,
              "W: bf16, layers * ", kLayerChunks, " chunks of ", kChunkElems);
  TORCH_CHECK(h0.scalar_type() == torch::kFloat32 && h0.numel() >= kCols, "h0: float32 [1024]");
  TORCH_CHECK(words.scalar_type() == torch::kInt32 && words.numel() >= 11264, "words: int32 [11264]");
  TORCH_CHECK(part.scalar_type() == torch::kInt64 && part.numel() >= kB * 2 * kPart, "part: int64 [128 * 2 * 130]");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.numel() >= kCols, "out: float32 [1024]");
  TORCH_CHECK(programs >= 128 && programs <= 256, "programs: 128 to 256, not ", programs);
  TORCH_CHECK(pairs.is_cuda() && pairs.scalar_type() == torch::kInt32 && pairs.numel() == programs * 4,
              "pairs: int32 [programs, 4] on CUDA");
  TORCH_CHECK(ahead >= 1 && ahead <= kSlots * kPieces, "ahead: 1 to ", kSlots * kPieces, ", not ", ahead);
  auto* w = reinterpret_cast<unsigned*>(words.data_ptr<int>());
  const Handoffs ho{w, reinterpret_cast<unsigned long long*>(part.data_ptr<int64_t>()), w + 4096, w + 6144, w + 7168,
                    w + 10240};
  const int bytes = kSlots * kChunkBytes + (kPieces + 1) * kSlots * 8;
  C10_CUDA_CHECK(cudaFuncSetAttribute(tagged_layer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  tagged_layer_kernel<<<programs, kConsumers + 32, bytes, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(W.data_ptr<at::BFloat16>()), h0.data_ptr<float>(), ho,
      out.data_ptr<float>(), pairs.data_ptr<int>(), static_cast<unsigned>(seq), static_cast<int>(layers),
      static_cast<int>(ahead));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("launch", &launch, "a Qwen3-0.6B-shaped layer as a capped, tagged stream");
  m.def("layer_chunks", &layer_chunks, "32 KB chunks a layer");
}
