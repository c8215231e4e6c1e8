// What layer_chain_cuda.cu, tagged_layer_cuda.cu and the engine's tagged_layers.cu share: a producer warp's bulk copies into a ring
// of shared-memory slots (mbarriers), the consumer warps' named barrier, and the tagged 32-bit words
// of session 38's hand-offs (a bf16 value in the low half, a 16-bit tag in the high half;
// docs/benchmarks.md, "Session 38").
#pragma once

#include <cuda_bf16.h>

namespace bulk_stream {

constexpr unsigned kSpinLimit = 1u << 22;  // bounded polls: a lost word gives wrong outputs, not a hang

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

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

// After a block's mbar_init calls, before any thread uses the barriers (then a block barrier).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// The 256 consumer threads of a block whose last warps are a producer (named barrier 1).
constexpr int kConsumerThreads = 256;
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Arm mbarrier ``full`` (an arrival) for ``bytes`` more bytes to land.
__device__ __forceinline__ void expect_bytes(unsigned full, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full), "r"(bytes) : "memory");
}

// Copy ``bytes`` from global ``src`` to shared ``dst``, counted on mbarrier ``full`` (L2 evict-first).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned full,
                                          unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(full), "l"(policy)
      : "memory");
}

// Wait until copy ``o`` of a ring of ``slots`` slots of kPieces copies (one mbarrier each,
// slot-major from ``full0``) has landed; o < 0: nothing to wait for. The producer calls it before
// copy o + ahead, so that at most ``ahead`` copies are requested and not yet landed. With ahead <=
// slots * kPieces copy o's mbarrier is not re-armed before then (at equality it is the slot's last
// use, which the consumers have released, so its phase is complete).
template <int kPieces>
__device__ __forceinline__ void wait_landed(unsigned full0, int o, int slots) {
  if (o >= 0) mbar_wait(full0 + ((o / kPieces) % slots * kPieces + o % kPieces) * 8, (o / kPieces / slots) & 1);
}

__device__ __forceinline__ unsigned tagged_word(float v, unsigned tag) {
  return (tag << 16) | __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

__device__ __forceinline__ float word_value(unsigned word) { return __uint_as_float(word << 16); }

// One store, so that a reader sees the word whole.
__device__ __forceinline__ void store_word(unsigned* p, unsigned word) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(word) : "memory");
}

__device__ __forceinline__ uint4 load_words(const unsigned* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ bool current(const uint4& v, unsigned tag) {
  return (v.x >> 16) == tag && (v.y >> 16) == tag && (v.z >> 16) == tag && (v.w >> 16) == tag;
}

// The four words at p once all carry ``tag`` (or after kSpinLimit polls).
__device__ __forceinline__ uint4 spin_for(const unsigned* p, unsigned tag) {
  uint4 v;
  unsigned spins = 0;
  do v = load_words(p);
  while (!current(v, tag) && ++spins < kSpinLimit);
  return v;
}

__device__ __forceinline__ float4 word_values(const uint4& v) {
  return make_float4(word_value(v.x), word_value(v.y), word_value(v.z), word_value(v.w));
}

// The lane's 32 values of a 1,024-vector in shared memory (columns lane*8 + k*256 .. +8, k < 4): the
// layout of ``row_dot``'s rows.
__device__ __forceinline__ void lane_slice(const float* xs, int lane, float (&x)[4][8]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float4 a = *reinterpret_cast<const float4*>(xs + lane * 8 + k * 256);
    const float4 b = *reinterpret_cast<const float4*>(xs + lane * 8 + k * 256 + 4);
    x[k][0] = a.x; x[k][1] = a.y; x[k][2] = a.z; x[k][3] = a.w;
    x[k][4] = b.x; x[k][5] = b.y; x[k][6] = b.z; x[k][7] = b.w;
  }
}

// A lane's share of a row's dot product, not summed over the warp: its KB 16-byte pieces of the row
// (8 bf16 each) against its inputs, in kChains independent sums (1: one chain of multiply-adds; 4:
// the multiply-adds do not wait on one another).
template <int kChains, int KB>
__device__ __forceinline__ float lane_dot(const uint4 (&w)[KB], const float (&x)[KB][8]) {
  static_assert(kChains == 1 || kChains == 4, "one chain, or one for each bf16 pair of a piece");
  float acc[kChains] = {};
#pragma unroll
  for (int k = 0; k < KB; ++k) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w[k]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(h[e]);
      acc[e % kChains] = fmaf(f.x, x[k][2 * e], acc[e % kChains]);
      acc[e % kChains] = fmaf(f.y, x[k][2 * e + 1], acc[e % kChains]);
    }
  }
  if constexpr (kChains == 1) return acc[0];
  else return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// A row's dot product, one chain of multiply-adds a lane, summed over the warp (every lane gets it).
template <int KB>
__device__ __forceinline__ float row_dot(const uint4 (&w)[KB], const float (&x)[KB][8]) {
  float acc = lane_dot<1>(w, x);
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  return acc;
}

// N values summed over the warp, their shuffles interleaved (every lane gets the sums).
template <int N>
__device__ __forceinline__ void warp_sums(float (&v)[N]) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1)
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], m);
}

// What tagged_layers.cu (the engine's kernel) and tagged_layer_cuda.cu (its benchmark) share: the
// hand-off stores, the two kinds of 16-byte groups a hand-off is
// polled in, the poll, and tensor cores' m16n8k16 over a packed chunk.

__device__ __forceinline__ void hand_bf16(unsigned* X, int i, float v, unsigned tag) {
  store_word(X + i, tagged_word(v, tag));
}

// A float32 hand-off word of 64 bits: the value in the low half, the tag in the high half.
__device__ __forceinline__ void hand_f32(unsigned long long* X, int i, float v, unsigned tag) {
  const unsigned long long word = (static_cast<unsigned long long>(tag) << 32) | __float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(X + i), "l"(word) : "memory");
}

// The two kinds of 16-byte groups a hand-off is polled in: four bf16 words (value, 16-bit tag) and
// two float32 words of 64 bits (value, 32-bit tag; each 64-bit element of the vector load is read
// whole). ``put`` stores a group's values as float32 at dst + (values a group) * g.
struct Bf16Group {
  using Word = unsigned;
  uint4 v;
  __device__ __forceinline__ void load(const Word* p) { v = load_words(p); }
  __device__ __forceinline__ bool current(unsigned tag) const { return bulk_stream::current(v, tag); }
  __device__ __forceinline__ void put(float* dst, int g) const {
    *reinterpret_cast<float4*>(dst + 4 * g) = word_values(v);
  }
};

struct F32Group {
  using Word = unsigned long long;
  ulonglong2 v;
  __device__ __forceinline__ void load(const Word* p) {
    asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
  }
  __device__ __forceinline__ bool current(unsigned tag) const { return (v.x >> 32) == tag && (v.y >> 32) == tag; }
  __device__ __forceinline__ void put(float* dst, int g) const {
    dst[2 * g] = __uint_as_float(static_cast<unsigned>(v.x));
    dst[2 * g + 1] = __uint_as_float(static_cast<unsigned>(v.y));
  }
};

// m16n8k16 with bf16 inputs and float32 sums: d += a · b.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint4& a, const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b[0]), "r"(b[1]));
}

// A hand-off polled in one round trip by the consumers (kConsumerThreads): each thread loads all of
// its (up to kMax) groups before it waits on any, then reloads only groups whose tags are not yet
// current: at most ``limit`` loads a group (for timing only, 1: read once, unchecked; 0: not read at
// all), ``backoff`` ns apart (0: at once). Group g (< groups) is read from src(g). A group still stale
// after its loads is taken as it is and, given ``faults``, counted there (wrong outputs, not a hang).
// Polling group by group would cost a round trip each: 26 a layer, not 6. The caller synchronises the
// consumers afterwards.
template <class Group, int kMax, class Src>
__device__ __forceinline__ void poll(int groups, Src src, float* dst, unsigned tag, unsigned limit, unsigned backoff,
                                     unsigned* faults = nullptr) {
  if (limit == 0) return;
  Group v[kMax];
#pragma unroll
  for (int k = 0; k < kMax; ++k) {
    const int g = threadIdx.x + k * kConsumerThreads;
    if (g < groups) v[k].load(src(g));
  }
#pragma unroll
  for (int k = 0; k < kMax; ++k) {
    const int g = threadIdx.x + k * kConsumerThreads;
    if (g >= groups) break;
    unsigned spins = 1;
    for (; !v[k].current(tag) && spins < limit; ++spins) {
      if (backoff) __nanosleep(backoff);
      v[k].load(src(g));
    }
    if (faults != nullptr && spins == limit) atomicAdd(faults, 1u);  // gave up (or current at the last load)
    v[k].put(dst, g);
  }
}

// n bf16 words of X from its start (n a multiple of 4, at most kMax * 1,024).
template <int kMax>
__device__ __forceinline__ void poll_bf16(const unsigned* X, int n, unsigned tag, float* dst, unsigned limit,
                                          unsigned backoff, unsigned* faults = nullptr) {
  poll<Bf16Group, kMax>(n / 4, [X](int g) { return X + 4 * g; }, dst, tag, limit, backoff, faults);
}

// A chunk packed as m16n8k16 A fragments (warp w's 8 k-tiles, 16 bytes a lane a tile) against the
// warp's B fragments b, summed in two chains: d[k % 2] += a_k · b_k.
__device__ __forceinline__ void mma_chunk(float (&d)[2][4], const unsigned char* chunk, const unsigned (&b)[8][2]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint4* a = reinterpret_cast<const uint4*>(chunk) + warp * 8 * 32 + lane;
#pragma unroll
  for (int k = 0; k < 8; ++k) mma_bf16(d[k % 2], a[k * 32], b[k]);
}

// The 8 consumer warps' sums d of a 16-row task meet in shared memory (red, a consumer barrier):
// thread p < 8 gets rows 2p and 2p + 1 in acc. B's columns are all the same input, so d[.][0] is row
// g's sum and d[.][2] row g + 8's (g = lane / 4).
__device__ __forceinline__ void meet_warp_sums(const float (&d)[2][4], float (*red)[16], float (&acc)[2]) {
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  if ((lane & 3) == 0) {
    red[warp][lane >> 2] = d[0][0] + d[1][0];
    red[warp][(lane >> 2) + 8] = d[0][2] + d[1][2];
  }
  consumers_sync();
  if (t < 8)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) s += red[w][2 * t + r];
      acc[r] = s;
    }
}

// 1 / rms of a 1,024-vector whose 4 values 4t .. 4t + 3 thread t holds in v (sums meet in red[8],
// a consumer barrier): rsqrt(mean(x^2) + eps), the same in every consumer thread.
__device__ __forceinline__ float inv_rms_1024(const float4& v, float* red, float eps) {
  const int t = threadIdx.x;
  float s = v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
  if ((t & 31) == 0) red[t >> 5] = s;
  consumers_sync();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < 8; ++w) total += red[w];
  return rsqrtf(total / 1024 + eps);
}

// Each lane's 16 values summed over the warp together by halving exchanges (16 shuffles, not 80): at
// the step over lane bit m a lane keeps the half of its values its bit selects and adds its
// partner's copy of that half; after a last plain exchange over bit 0, lane l holds in v[0] the sum
// of value l / 2.
__device__ __forceinline__ void halving_sums16(float (&v)[16], int lane) {
#pragma unroll
  for (int m = 16, n = 8; n >= 1; m >>= 1, n >>= 1) {
    const bool upper = lane & m;
#pragma unroll
    for (int i = 0; i < n; ++i) {
      const float send = upper ? v[i] : v[i + n], keep = upper ? v[i + n] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, m);
    }
  }
  v[0] += __shfl_xor_sync(0xffffffffu, v[0], 1);
}

}  // namespace bulk_stream
