// bench_layer_chain.py's "barriers" and "stream" designs written by hand in CUDA C++ (same data
// flow, same weights, same outputs): does the Triton and Gluon kernels' code, rather than the chain
// itself, cost time? (docs/benchmarks.md, session 36). Then edges inside thread-block clusters
// (which Triton cannot express), reductions in place of a phase's barrier, and the "split" design
// built on both (session 37).
//
// barriers: one block of 256 threads per multiprocessor. Per phase: arrive at the grid barrier
// (thread 0, release), issue the phase's weight rows into registers, wait (thread 0 polls with
// acquire loads), load the input vector from L2, dot products (warp w owns rows 2w and 2w+1 of each
// 16-row chunk; lane l columns l*8 + k*256 .. +8, k < 4), store.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <tuple>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

#include "bulk_stream.cuh"

namespace cg = cooperative_groups;

namespace {

using namespace bulk_stream;

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

// Poll a counter (acquire loads) until it reaches ``target``.
__device__ __forceinline__ void spin_until(const unsigned* counter, unsigned target) {
  unsigned seen;
  do {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
  } while (seen < target);
}

// Wait until phase ``phases`` (counting from 1) has every program's arrival.
template <int kCounters>
__device__ __forceinline__ void wait_for(const unsigned* bar, unsigned phases) {
  const int t = threadIdx.x;
  if (t < kCounters) {
    const int programs = gridDim.x;
    spin_until(bar + t * kLine, phases * (programs / kCounters + (t < programs % kCounters ? 1 : 0)));
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

// The lane's pieces of the program's C chunks of phase rows starting at chunk j0 (warp w: rows 2w and
// 2w+1 of each chunk), into registers.
template <int C, bool kEvictFirst>
__device__ __forceinline__ void load_tiles(const __nv_bfloat16* W, int layer, int j0, int programs, int pid,
                                           uint4 (&w)[C][2][4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
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
}

// The dots of the tiles ``load_tiles`` gave against x, each passed by lane 0 of its warp to
// ``use(row, acc)``, row counted in the program's C * 16 outputs.
template <int C, typename Use>
__device__ __forceinline__ void each_dot(const uint4 (&w)[C][2][4], const float (&x)[4][8], Use use) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float acc = row_dot(w[c][i], x);
      if (lane == 0) use(c * 16 + 2 * warp + i, acc);
    }
}

// The dots stored at their row of the program's outputs (and, kShared, of ``shared``: the block's
// shared-memory copy).
template <int C, bool kShared>
__device__ __forceinline__ void store_dots(const uint4 (&w)[C][2][4], const float (&x)[4][8], float* out,
                                           float* shared) {
  each_dot(w, x, [&](int row, float acc) {
    out[row] = acc;
    if constexpr (kShared) shared[row] = acc;
  });
}

template <int C, bool kEvictFirst, int kCounters>
__device__ __forceinline__ void phase(const __nv_bfloat16* W, const float* X, float* out, unsigned* bar, int layer,
                                      int ph, int j0, int programs, int pid) {
  const int lane = threadIdx.x & 31;
  arrive<kCounters>(bar);
  uint4 w[C][2][4];
  load_tiles<C, kEvictFirst>(W, layer, j0, programs, pid, w);
  wait_for<kCounters>(bar, static_cast<unsigned>(layer * 5 + ph + 1));
  float x[4][8];
  load_input(X, lane, x);
  store_dots<C, false>(w, x, out + pid * 16 * C, nullptr);
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

// ---- tagged: no grid barrier. Each block hands its first eight outputs of a phase on as 32-bit
// words, the value rounded to bf16 in the low half and the phase's 16-bit tag in the high half (one
// store: a reader sees a word whole), and the next phase polls every block's words until all tags are
// current: one L2 round trip once they are there, where a barrier takes its arrival, its poll and
// then the input load. (The real kernel rounds each projection's output to bf16 anyway.) Every
// block's words are waited on, so no block can fall a layer behind: a phase's words are rewritten
// five phases later, when every block has read them. kPoll 0: each thread spins on its own words,
// then one block barrier; 1: the block checks every word after each poll. kEarly: the phase's weight
// rows are issued before polling (as the barriers design issues them between arriving and waiting),
// otherwise once the input is there.

// An "and" over the polling threads: the whole block, or (beside a producer warp) the consumers.
template <bool kWholeBlock>
__device__ __forceinline__ bool threads_and(bool ok) {
  if constexpr (kWholeBlock) {
    return __syncthreads_and(ok);
  } else {
    unsigned all;
    asm volatile(
        "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, 1, 256, p;\n selp.u32 %0, 1, 0, q;\n}"
        : "=r"(all)
        : "r"(static_cast<unsigned>(ok))
        : "memory");
    return all != 0;
  }
}

template <bool kWholeBlock>
__device__ __forceinline__ void threads_sync() {
  if constexpr (kWholeBlock) {
    __syncthreads();
  } else {
    consumers_sync();
  }
}

// Wait until ``words`` tagged words of ``X`` (a multiple of 4, at most 2,048) carry ``tag``; the
// first 1,024 values go to ``xs`` (shared memory) as float32. Threads 0-255 poll. (kPoll 2: no polling,
// one read of the first 1,024 words whatever their tags: timing only.)
template <int kPoll, bool kWholeBlock>
__device__ __forceinline__ void poll_tagged(const unsigned* X, unsigned tag, int words, float* xs) {
  const int t = threadIdx.x, groups = words / 4;
  uint4 v[2];
  if constexpr (kPoll == 2) {  // one read, whatever it holds (timing only: races)
    v[0] = load_words(X + 4 * t);
  } else if constexpr (kPoll == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int g = t + r * 256;
      if (g < groups) v[r] = spin_for(X + 4 * g, tag);
    }
  } else {
    bool done = false;
    for (unsigned spins = 0; !done && spins < kSpinLimit; ++spins) {
      bool ok = true;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int g = t + r * 256;
        if (g < groups) {
          v[r] = load_words(X + 4 * g);
          ok = ok && current(v[r], tag);
        }
      }
      done = threads_and<kWholeBlock>(ok);
    }
  }
  if (t < kCols / 4) *reinterpret_cast<float4*>(xs + 4 * t) = word_values(v[0]);
  threads_sync<kWholeBlock>();
}

// The first phase of a launch reads ones (no tagged input yet), as the flags design.
__device__ __forceinline__ void ones(float (&x)[4][8]) {
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) x[k][e] = 1.f;
}

// The tag of global phase g (layer * 5 + phase) of launch ``seq``: never 0 (the buffers start
// zeroed) and, for 468 launches of 28 layers, never a tag of another launch.
__device__ __forceinline__ unsigned phase_tag(unsigned seq, int layers, int g) {
  return 1u + (seq * 5u * layers + g) % 65535u;
}

// The input of global phase g: ones, or the tagged words of the phase before, polled (``xs``: 2 × 1,024).
template <int kPoll, bool kWholeBlock>
__device__ __forceinline__ void tagged_input(const unsigned* X, float* xs, unsigned seq, int layers, int g,
                                             int programs, float (&x)[4][8]) {
  if (g == 0) {
    ones(x);
  } else {
    float* half = xs + (g & 1) * kCols;  // two copies: a warp may poll the next phase's before all have read this
    poll_tagged<kPoll, kWholeBlock>(X, phase_tag(seq, layers, g - 1), programs * 8, half);
    lane_slice(half, threadIdx.x & 31, x);
  }
}

// Row ``row`` (< 8) of the block's first chunk, handed on: bf16 value and tag in one word.
__device__ __forceinline__ void hand_on(unsigned* XN, int pid, int row, float acc, unsigned tag) {
  store_word(XN + pid * 8 + row, tagged_word(acc, tag));
}

template <int C, bool kEarly, int kPoll>
__device__ __forceinline__ void tagged_phase(const __nv_bfloat16* W, const unsigned* X, unsigned* XN, float* out,
                                             float* xs, unsigned seq, int layers, int layer, int ph, int j0,
                                             int programs, int pid) {
  const int g = layer * 5 + ph;
  uint4 w[C][2][4];
  if constexpr (kEarly) load_tiles<C, true>(W, layer, j0, programs, pid, w);
  float x[4][8];
  tagged_input<kPoll, true>(X, xs, seq, layers, g, programs, x);
  if constexpr (!kEarly) load_tiles<C, true>(W, layer, j0, programs, pid, w);
  const unsigned tag = phase_tag(seq, layers, g);
  each_dot(w, x, [&](int row, float acc) {
    if (row < 8) hand_on(XN, pid, row, acc, tag);  // the first chunk's first eight rows: the hand-off first
    out[pid * 16 * C + row] = acc;
  });
}

template <bool kEarly, int kPoll>
__global__ void __launch_bounds__(256, 1)
    tagged_kernel(const __nv_bfloat16* W, float* buf, unsigned* xt, unsigned seq, int layers, int stride) {
  __shared__ __align__(16) float xs[2 * kCols];
  const int pid = blockIdx.x, programs = gridDim.x;
  for (int layer = 0; layer < layers; ++layer) {
    tagged_phase<2, kEarly, kPoll>(W, xt + 4 * 2048, xt + 0 * 2048, buf + 0 * stride, xs, seq, layers, layer, 0, 0,
                                   programs, pid);
    tagged_phase<1, kEarly, kPoll>(W, xt + 0 * 2048, xt + 1 * 2048, buf + 1 * stride, xs, seq, layers, layer, 1, 2,
                                   programs, pid);
    tagged_phase<1, kEarly, kPoll>(W, xt + 1 * 2048, xt + 2 * 2048, buf + 2 * stride, xs, seq, layers, layer, 2, 3,
                                   programs, pid);
    tagged_phase<3, kEarly, kPoll>(W, xt + 2 * 2048, xt + 3 * 2048, buf + 3 * stride, xs, seq, layers, layer, 3, 4,
                                   programs, pid);
    tagged_phase<2, kEarly, kPoll>(W, xt + 3 * 2048, xt + 4 * 2048, buf + 4 * stride, xs, seq, layers, layer, 4, 7,
                                   programs, pid);
  }
}

// ---- The stream in CUDA C++: a producer warp copies every chunk by cp.async.bulk into a ring of
// kSlots 32 KB shared-memory slots (L2 evict-first; four 8 KB copies a chunk, each with its own
// mbarrier), eight consumer warps run the barrier (or poll the tagged input), the input load and the
// dots from shared memory (bench_layer_chain.py's Gluon "stream", without Gluon). The producer may
// cap the copies it has requested and not yet received (``ahead``), however many slots are free:
// session 38 found that cap (32 KB a block) is what lets the tagged stream beat today's pattern.

constexpr int kSlots = 6;
constexpr int kChunkBytes = 16 * kCols * 2;
constexpr int kConsumers = 256;
constexpr int kPieces = 4;  // copies per chunk (8 KB each)

// The grid barrier of designs with a producer warp: only the consumer warps take part.
__device__ __forceinline__ void grid_arrive(unsigned* counter) {
  consumers_sync();  // the consumer warps' writes and reductions precede the arrival
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}

__device__ __forceinline__ void grid_wait(const unsigned* counter, unsigned target) {
  if (threadIdx.x == 0) spin_until(counter, target);
  consumers_sync();
}

// kSync: 0 none (races: timing only), 1 grid barriers among the consumer warps, 2 tagged inputs; timing
// only: 3 no input at all (ones), 4 the tagged words read once into shared memory without their tags checked.
// kDefer: a phase's slots go back to the producer only once the next phase's input is there (``held``: how
// many slots, ending at chunk i, are still held), so that no copy is requested while the block waits.
template <int C, int kSync, bool kDefer>
__device__ __forceinline__ int stream_phase(const unsigned char* ring, unsigned full0, unsigned empty0, const float* X,
                                            float* out, unsigned* bar, const unsigned* XT, unsigned* XTN, float* xs,
                                            unsigned seq, int layers, int layer, int ph, int i, int pid, int& held) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = layer * 5 + ph;
  float x[4][8];
  if constexpr (kSync == 2 || kSync == 4) {
    tagged_input<kSync == 2 ? 0 : 2, false>(XT, xs, seq, layers, g, gridDim.x, x);
  } else if constexpr (kSync == 3) {
    ones(x);
  } else {
    if constexpr (kSync == 1) {
      grid_arrive(bar);
      grid_wait(bar, static_cast<unsigned>((g + 1) * gridDim.x));
    }
    load_input(X, lane, x);
  }
  if constexpr (kDefer) {
    if (lane == 0)
      for (int j = i - held; j < i; ++j)
        mbar_arrive(empty0 + (j % kSlots) * 8);
    held = C;
  }
#pragma unroll
  for (int c = 0; c < C; ++c, ++i) {
    const int slot = i % kSlots;
    mbar_wait(full0 + (slot * kPieces + warp / 2) * 8, (i / kSlots) & 1);  // the copy that holds the warp's rows
    const unsigned char* chunk = ring + slot * kChunkBytes;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 2 * warp + r;
      uint4 w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        w[k] = *reinterpret_cast<const uint4*>(chunk + (row * kCols + lane * 8 + k * 256) * 2);
      const float acc = row_dot(w, x);
      if (lane == 0) {
        if ((kSync == 2 || kSync == 4) && c == 0 && row < 8) hand_on(XTN, pid, row, acc, phase_tag(seq, layers, g));
        out[pid * 16 * C + c * 16 + row] = acc;
      }
    }
    __syncwarp();
    if (!kDefer && lane == 0) mbar_arrive(empty0 + slot * 8);
  }
  return i;
}

template <int kSync, bool kDefer>
__global__ void __launch_bounds__(kConsumers + 32, 1)
    stream_kernel(const __nv_bfloat16* W, float* buf, unsigned* bar, unsigned* xt, unsigned seq, int layers,
                  int stride, int ahead) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(16) float xs[2 * kCols];
  unsigned char* ring = smem;
  const unsigned full0 = smem_addr(smem + kSlots * kChunkBytes);  // one barrier per copy (4 rows), slot-major
  const unsigned empty0 = full0 + kSlots * kPieces * 8;
  const int pid = blockIdx.x, programs = gridDim.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) {
      for (int piece = 0; piece < kPieces; ++piece)
        mbar_init(full0 + (s * kPieces + piece) * 8, 1);
      mbar_init(empty0 + s * 8, 8);  // one per consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers) {  // the producer warp: one thread issues every copy
    if (threadIdx.x == kConsumers) {
      const unsigned long long policy = evict_first_policy();
      int i = 0;
      for (int layer = 0; layer < layers; ++layer)
        for (int j = 0; j < kChunks; ++j, ++i) {
          const int slot = i % kSlots;
          mbar_wait(empty0 + slot * 8, ((i / kSlots) & 1) ^ 1);
          const long row0 = (static_cast<long>(layer * kChunks + j) * programs + pid) * 16;
          for (int piece = 0; piece < kPieces; ++piece) {  // several copies in flight per chunk
            wait_landed<kPieces>(full0, i * kPieces + piece - ahead, kSlots);  // at most ``ahead`` in flight
            const unsigned full = full0 + (slot * kPieces + piece) * 8;
            expect_bytes(full, kChunkBytes / kPieces);
            bulk_copy(ring + slot * kChunkBytes + piece * (kChunkBytes / kPieces),
                      W + row0 * kCols + piece * (kChunkBytes / kPieces / 2), kChunkBytes / kPieces, full, policy);
          }
        }
    }
    return;
  }
  int i = 0, held = 0;
  for (int layer = 0; layer < layers; ++layer) {
    i = stream_phase<2, kSync, kDefer>(ring, full0, empty0, buf + 4 * stride, buf + 0 * stride, bar, xt + 4 * 2048,
                               xt + 0 * 2048, xs, seq, layers, layer, 0, i, pid, held);
    i = stream_phase<1, kSync, kDefer>(ring, full0, empty0, buf + 0 * stride, buf + 1 * stride, bar, xt + 0 * 2048,
                               xt + 1 * 2048, xs, seq, layers, layer, 1, i, pid, held);
    i = stream_phase<1, kSync, kDefer>(ring, full0, empty0, buf + 1 * stride, buf + 2 * stride, bar, xt + 1 * 2048,
                               xt + 2 * 2048, xs, seq, layers, layer, 2, i, pid, held);
    i = stream_phase<3, kSync, kDefer>(ring, full0, empty0, buf + 2 * stride, buf + 3 * stride, bar, xt + 2 * 2048,
                               xt + 3 * 2048, xs, seq, layers, layer, 3, i, pid, held);
    i = stream_phase<2, kSync, kDefer>(ring, full0, empty0, buf + 3 * stride, buf + 4 * stride, bar, xt + 3 * 2048,
                               xt + 4 * 2048, xs, seq, layers, layer, 4, i, pid, held);
  }
}

// ---- The barriers design with some edges inside a thread-block cluster, and the last two phases
// fused as split-K. A phase whose bit is set in ``mask`` waits on the cluster's hardware barrier
// instead of the grid barrier and reads its input from the cluster's shared memory (the vector tiles
// the cluster's outputs of the phase before, each block's in rank order) instead of from L2: what an
// edge costs when its data never leaves a GPC. ``kSplitK``: the fourth phase also issues the fifth's
// 32 rows, read as a [32, 1024] slice of a split-K product: its own first 32 outputs times those rows,
// added into the layer's 1,024 sums by vector reductions, which the next layer's first phase reads
// after the grid barrier (one grid edge fewer a layer; the sums must start at zero).

constexpr int kMaxOut = 48;  // a phase's outputs per block (3 chunks of 16 rows)

__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// The lane's values (lane l: columns l*8 + k*256 + shift .. +8, k < KB) of the vector that tiles the
// cluster's outputs (``per`` values a block, in rank order), read from the blocks' shared memory.
template <int KB>
__device__ __forceinline__ void gather(const float* xs, int per, int lane, int shift, float (&y)[KB][8]) {
  cg::cluster_group cluster = cg::this_cluster();
  const int n = static_cast<int>(cluster.num_blocks());
#pragma unroll
  for (int k = 0; k < KB; ++k) {
    const int j = (lane * 8 + k * 256 + shift) % (per * n);
    const float4* p = reinterpret_cast<const float4*>(cluster.map_shared_rank(xs, j / per) + j % per);
    const float4 a = p[0], b = p[1];
    y[k][0] = a.x; y[k][1] = a.y; y[k][2] = a.z; y[k][3] = a.w;
    y[k][4] = b.x; y[k][5] = b.y; y[k][6] = b.z; y[k][7] = b.w;
  }
}

// A phase of C chunks; kSplitK (the fourth phase only) also runs the fifth as split-K into ``sums``.
template <int C, bool kCluster, bool kSplitK>
__device__ __forceinline__ void edge_phase(const __nv_bfloat16* W, const float* X, float* out, float* sums,
                                           unsigned* bar, const float* xs_in, float* xs_out, int m_in, int layer,
                                           int j0, unsigned edges, int programs, int pid) {
  const int t = threadIdx.x, lane = t & 31;
  if constexpr (kCluster) {
    cluster_arrive();
  } else {
    arrive<1>(bar);
  }
  uint4 w[C][2][4];
  load_tiles<C, true>(W, layer, j0, programs, pid, w);
  uint2 we[kSplitK ? 32 : 1];
  if constexpr (kSplitK) {  // the fifth phase's rows: thread t owns columns 4t .. 4t+3 of each
    const long e0 = (static_cast<long>(layer * kChunks + j0 + C) * programs + pid) * 16;
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      const long row = e0 + static_cast<long>(r / 16) * programs * 16 + r % 16;
      we[r] = __ldcs(reinterpret_cast<const uint2*>(W + row * kCols + t * 4));
    }
  }
  if constexpr (kCluster) {
    cluster_wait();
  } else {
    wait_for<1>(bar, edges);
  }
  float x[4][8];
  if constexpr (kCluster) {
    gather<4>(xs_in, m_in, lane, 0, x);
  } else {
    load_input(X, lane, x);
  }
  store_dots<C, true>(w, x, out + pid * 16 * C, xs_out);
  if constexpr (kSplitK) {
    __syncthreads();  // the block's outputs, written by each warp's lane 0
    float a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      const float d = xs_out[r];
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&we[r]);
      const float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
      a[0] = fmaf(d, f0.x, a[0]);
      a[1] = fmaf(d, f0.y, a[1]);
      a[2] = fmaf(d, f1.x, a[2]);
      a[3] = fmaf(d, f1.y, a[3]);
    }
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(sums + t * 4), "f"(a[0]),
                 "f"(a[1]), "f"(a[2]), "f"(a[3])
                 : "memory");
  }
}

template <int C, bool kSplitK = false>
__device__ __forceinline__ void either_phase(bool cluster, const __nv_bfloat16* W, const float* X, float* out,
                                             float* sums, unsigned* bar, const float* xs_in, float* xs_out, int m_in,
                                             int layer, int j0, unsigned& edges, int programs, int pid) {
  if (cluster) {
    edge_phase<C, true, kSplitK>(W, X, out, sums, bar, xs_in, xs_out, m_in, layer, j0, edges, programs, pid);
  } else {
    edge_phase<C, false, kSplitK>(W, X, out, sums, bar, xs_in, xs_out, m_in, layer, j0, ++edges, programs, pid);
  }
}

template <bool kSplitK>
__global__ void __launch_bounds__(256, 1)
    edges_kernel(const __nv_bfloat16* W, float* buf, float* sums, unsigned* bar, int layers, int stride, int mask) {
  __shared__ __align__(16) float xs[5][kMaxOut];
  const int pid = blockIdx.x, programs = gridDim.x;
  cg::this_cluster().sync();  // every block of the cluster runs before any reads another's memory
  unsigned edges = 0;  // grid barriers passed
  for (int layer = 0; layer < layers; ++layer) {
    const float* x0 = kSplitK && layer > 0 ? sums + (layer - 1) * kCols : buf + 4 * stride;
    either_phase<2>(false, W, x0, buf, sums, bar, xs[4], xs[0], 32, layer, 0, edges, programs, pid);
    either_phase<1>(mask & 2, W, buf, buf + stride, sums, bar, xs[0], xs[1], 32, layer, 2, edges, programs, pid);
    either_phase<1>(mask & 4, W, buf + stride, buf + 2 * stride, sums, bar, xs[1], xs[2], 16, layer, 3, edges,
                    programs, pid);
    if constexpr (kSplitK) {
      either_phase<3, true>(mask & 8, W, buf + 2 * stride, buf + 3 * stride, sums + layer * kCols, bar, xs[2], xs[3],
                            16, layer, 4, edges, programs, pid);
    } else {
      either_phase<3>(mask & 8, W, buf + 2 * stride, buf + 3 * stride, sums, bar, xs[2], xs[3], 16, layer, 4, edges,
                      programs, pid);
      either_phase<2>(mask & 16, W, buf + 3 * stride, buf + 4 * stride, sums, bar, xs[3], xs[4], 48, layer, 7, edges,
                      programs, pid);
    }
  }
  cg::this_cluster().sync();  // no block leaves while another may still read its shared memory
}


// ---- The split design: Qwen3-0.6B's real bytes (35.7 MB a layer at 1,024 cached rows), two grid
// edges a layer, the rest inside clusters of four (docs/benchmarks.md, session 37).
//
// Blocks 0-31 ("attention side", a cluster per KV head): each block computes 128 of its head's 512
// q/k/v rows (256 KB), shares them with its cluster through shared memory, reads 128 KB of "cache"
// rows against the head's 512 values, shares those partials, merges (the first half plus the second),
// and multiplies the merged 256 values into 256 rows of the output projection's slice (128 KB), added
// into the layer's mid sums by reductions. A producer warp streams the block's 512 KB a layer through
// a ring of six 32 KB slots, ahead across every edge. Blocks 32-119 ("MLP side"): a producer warp
// copies the block's 35 gate, 35 up and 35 down rows (210 KB) into shared memory as soon as the
// previous layer's are used, so they land while the attention side works; after the attention side's
// edge the block adds the mid sums into its copy of the residual stream, normalises, runs gate/up and
// SiLU·mul from shared memory, and its 35 values times the down rows (split-K) are added into the
// layer's out sums. Every block keeps the residual stream itself: h += mid, h += out.

constexpr int kHeads = 8, kRanks = 4, kAttnBlocks = kHeads * kRanks, kMlpBlocks = 88;
constexpr int kSplitBlocks = kAttnBlocks + kMlpBlocks;
constexpr int kInter = 35;                                    // intermediate rows an MLP block owns
constexpr long kAttnBytes = 512L * 1024, kMlpBytes = 3L * kInter * kCols * 2;  // per block a layer
constexpr long kLayerElems = (kAttnBlocks * kAttnBytes + kMlpBlocks * kMlpBytes) / 2;
constexpr int kAttnChunks = 16;                               // 32 KB each: 8 q/k/v, 4 cache, 4 output
constexpr int kMlpPieces = 7, kPieceBytes = kMlpBytes / kMlpPieces;  // 15 rows each
constexpr int kSplitSmem = kMlpBytes + 1024;                  // + mbarriers

// Each warp holds the whole residual stream (lane l: columns l*8 + k*256 .. +8): add a vector from L2.
__device__ __forceinline__ void add_from(const float* v, int lane, float (&h)[4][8]) {
  float a[4][8];
  load_input(v, lane, a);
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) h[k][e] += a[k][e];
}

// RMS-normalised residual stream (no weight), in the same layout; every warp computes it alone.
__device__ __forceinline__ void normed(const float (&h)[4][8], float (&x)[4][8]) {
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) ss = fmaf(h[k][e], h[k][e], ss);
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  const float r = rsqrtf(ss / kCols + 1e-6f);
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) x[k][e] = h[k][e] * r;
}

// A row of KB*256 bf16 columns in shared memory (lane l: columns l*8 + k*256 .. +8) against x.
template <int KB>
__device__ __forceinline__ float smem_row_dot(const unsigned char* row, int lane, const float (&x)[KB][8]) {
  uint4 w[KB];
#pragma unroll
  for (int k = 0; k < KB; ++k) w[k] = *reinterpret_cast<const uint4*>(row + (lane * 8 + k * 256) * 2);
  return row_dot(w, x);
}

// The attention side's next ``n`` chunks from its ring, each R rows of KB*256 columns (warp w: rows
// R/8*w .. R/8*(w+1)), their dots with x handed to ``emit(row, value)`` by lane 0; each slot is freed
// once every warp is done with it. ``wait``: false for the timing-only run without bytes.
template <int KB, int R, typename Emit>
__device__ __forceinline__ void ring_rows(const unsigned char* ring, unsigned full0, unsigned empty0, bool wait, int n,
                                          int& i, const float (&x)[KB][8], Emit emit) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int kPerWarp = R / 8;
  for (int c = 0; c < n; ++c, ++i) {
    const int slot = i % 6;
    if (wait) mbar_wait(full0 + slot * 8, (i / 6) & 1);
#pragma unroll
    for (int r = 0; r < kPerWarp; ++r) {
      const int row = kPerWarp * warp + r;
      const float acc = smem_row_dot<KB>(ring + slot * kChunkBytes + row * KB * 256 * 2, lane, x);
      if (lane == 0) emit(c * R + row, acc);
    }
    __syncwarp();
    if (lane == 0 && wait) mbar_arrive(empty0 + slot * 8);
  }
}

// An edge inside the cluster: this block's shared-memory outputs are written (consumer barrier), then
// thread 0 tells each other block (a release store into its flags), and threads 0-3 wait for theirs.
__device__ __forceinline__ void cluster_edge(unsigned* flags, unsigned tag) {
  consumers_sync();
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned me = cluster.block_rank();
  const int t = threadIdx.x;
  if (t < kRanks && t != static_cast<int>(me)) {
    unsigned* theirs = cluster.map_shared_rank(flags + me, t);
    asm volatile("st.release.cluster.u32 [%0], %1;" ::"l"(theirs), "r"(tag) : "memory");
    unsigned seen;
    do {
      asm volatile("ld.acquire.cluster.u32 %0, [%1];" : "=r"(seen) : "l"(flags + t) : "memory");
    } while (seen != tag);
  }
  consumers_sync();
}

__device__ __forceinline__ long long globaltimer() {
  long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__global__ void __launch_bounds__(kConsumers + 32, 1)
    split_kernel(const __nv_bfloat16* W, const float* h0, float* sums, unsigned* bar, float* out, int layers,
                 long long* stamps, int mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(16) float xs[2][128];   // the attention side's shared outputs
  __shared__ __align__(16) float act[2 * kInter];
  __shared__ unsigned flags[2][kRanks];
  const int b = blockIdx.x, t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const bool attn = b < kAttnBlocks;
  const bool paced = mode == 1;            // the MLP side's copies wait for the attention side's edge
  const bool no_attn_bytes = mode == 2;    // the attention side computes on stale shared memory (timing only)
  const bool mlp_stores = mode == 3;       // the MLP side stores its partial sums, each block its own (timing only)
  const bool attn_stores = mode == 4;      // the attention side stores instead of adding (timing only)
  // %globaltimer at the chain's steps, by blocks 0 and 32 (16 a layer each), when stamps is given
  long long* mine = stamps && t == 0 && (b == 0 || b == kAttnBlocks) ? stamps + (b ? 8 : 0) : nullptr;
  auto stamp = [&](int layer, int k) {
    if (mine) mine[layer * 16 + k] = globaltimer();
  };
  // every MLP block's times past the attention side's edge (k 0) and at its end (k 1), after the 16 a layer
  auto stamp_mlp = [&](int layer, int k) {
    if (stamps && t == 0)
      stamps[(layers + 1) * 16 + (k * layers + layer) * kMlpBlocks + b - kAttnBlocks] = globaltimer();
  };
  const int nslots = attn ? 6 : kMlpPieces;
  const unsigned full0 = smem_addr(smem + kMlpBytes), empty0 = full0 + 8 * 8;
  unsigned* bar_mid = bar;        // the attention side's arrivals
  unsigned* bar_out = bar + 32;   // the MLP side's, on another L2 line
  if (t < 2 * kRanks) flags[t / kRanks][t % kRanks] = 0;
  if (t == 0) {
    for (int s = 0; s < nslots; ++s) {
      mbar_init(full0 + s * 8, 1);
      mbar_init(empty0 + s * 8, attn ? 8 : 1);
    }
    mbar_init_fence();
  }
  cg::this_cluster().sync();  // flags and mbarriers set in every block before any other touches them
  if (t >= kConsumers) {      // the producer warp: one thread issues every copy
    if (t != kConsumers || (attn && no_attn_bytes)) return;
    const unsigned long long policy = evict_first_policy();
    const long base = attn ? b * kAttnBytes : kAttnBlocks * kAttnBytes + (b - kAttnBlocks) * kMlpBytes;
    const int per_layer = attn ? kAttnChunks : kMlpPieces, piece = attn ? kChunkBytes : kPieceBytes;
    for (int i = 0; i < layers * per_layer; ++i) {
      const int layer = i / per_layer, j = i % per_layer, slot = attn ? i % 6 : j;
      const unsigned round = attn ? i / 6 : layer;
      mbar_wait(empty0 + (attn ? slot : 0) * 8, (round & 1) ^ 1);  // the MLP side frees a layer's all at once
      if (paced && !attn && j == 0) spin_until(bar_mid, kAttnBlocks * (layer + 1));  // after the attention side
      const unsigned full = full0 + slot * 8;
      expect_bytes(full, piece);
      const unsigned char* src = reinterpret_cast<const unsigned char*>(W) + layer * kLayerElems * 2 + base + j * piece;
      for (int q = 0; q < 4; ++q)
        bulk_copy(smem + slot * piece + q * (piece / 4), src + q * (piece / 4), piece / 4, full, policy);
    }
    return;
  }
  float h[4][8], x[4][8];
  load_input(h0, lane, h);
  const unsigned rank = cg::this_cluster().block_rank();
  int i = 0;  // the attention side's chunk count
  for (int layer = 0; layer < layers; ++layer) {
    float* mid = sums + (2 * layer) * kCols;
    float* mlp = sums + (2 * layer + 1) * kCols;
    if (attn) {
      if (layer > 0) {
        grid_wait(bar_out, kMlpBlocks * layer);
        add_from(sums + (2 * layer - 1) * kCols, lane, h);
      }
      stamp(layer, 0);
      normed(h, x);
      ring_rows<4, 16>(smem, full0, empty0, !no_attn_bytes, 8, i, x, [&](int row, float acc) { xs[0][row] = acc; });
      stamp(layer, 1);
      cluster_edge(flags[0], layer + 1);
      stamp(layer, 2);
      float y[2][8];
      gather<2>(xs[0], 128, lane, 0, y);
      ring_rows<2, 32>(smem, full0, empty0, !no_attn_bytes, 4, i, y, [&](int row, float acc) { xs[1][row] = acc; });
      stamp(layer, 3);
      cluster_edge(flags[1], layer + 1);
      stamp(layer, 4);
      float z[1][8], z2[1][8];
      gather<1>(xs[1], 128, lane, 0, z);
      gather<1>(xs[1], 128, lane, 256, z2);
#pragma unroll
      for (int e = 0; e < 8; ++e) z[0][e] += z2[0][e];  // the merge
      ring_rows<1, 64>(smem, full0, empty0, !no_attn_bytes, 4, i, z, [&](int row, float acc) {
        float* sum = mid + rank * 256 + row;  // the block's 256 rows of the layer's 1,024 sums
        if (attn_stores) {
          *sum = acc;
        } else {
          atomicAdd(sum, acc);
        }
      });
      stamp(layer, 5);
      grid_arrive(bar_mid);
      grid_wait(bar_mid, kAttnBlocks * (layer + 1));
      add_from(mid, lane, h);
    } else {
      if (layer > 0) {
        grid_wait(bar_out, kMlpBlocks * layer);
        add_from(sums + (2 * layer - 1) * kCols, lane, h);
      }
      grid_wait(bar_mid, kAttnBlocks * (layer + 1));
      stamp(layer, 0);
      stamp_mlp(layer, 0);
      add_from(mid, lane, h);
      normed(h, x);
      for (int s = 0; s < kMlpPieces; ++s) mbar_wait(full0 + s * 8, layer & 1);
      stamp(layer, 1);
      for (int r = warp; r < 2 * kInter; r += 8) {  // gate then up rows
        const float acc = smem_row_dot<4>(smem + r * kCols * 2, lane, x);
        if (lane == 0) act[r] = acc;
      }
      consumers_sync();
      stamp(layer, 2);
      if (t < kInter) act[t] = act[t] / (1.f + __expf(-act[t])) * act[kInter + t];
      consumers_sync();
      float a[4] = {0.f, 0.f, 0.f, 0.f};
      for (int r = 0; r < kInter; ++r) {  // down rows, split-K: thread t owns columns 4t .. 4t+3
        const uint2 w = *reinterpret_cast<const uint2*>(smem + ((2 * kInter + r) * kCols + 4 * t) * 2);
        const __nv_bfloat162* hw = reinterpret_cast<const __nv_bfloat162*>(&w);
        const float2 f0 = __bfloat1622float2(hw[0]), f1 = __bfloat1622float2(hw[1]);
        const float v = act[r];
        a[0] = fmaf(v, f0.x, a[0]);
        a[1] = fmaf(v, f0.y, a[1]);
        a[2] = fmaf(v, f1.x, a[2]);
        a[3] = fmaf(v, f1.y, a[3]);
      }
      if (mlp_stores) {
        *reinterpret_cast<float4*>(sums + (2 * layers + b - kAttnBlocks) * kCols + 4 * t) =
            make_float4(a[0], a[1], a[2], a[3]);
      } else {
        asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(mlp + 4 * t), "f"(a[0]),
                     "f"(a[1]), "f"(a[2]), "f"(a[3])
                     : "memory");
      }
      stamp(layer, 3);
      stamp_mlp(layer, 1);
      grid_arrive(bar_out);  // its consumer barrier also ends every read of the layer's rows
      if (t == 0) mbar_arrive(empty0);
    }
  }
  if (b == 0) {
    grid_wait(bar_out, kMlpBlocks * layers);
    add_from(sums + (2 * layers - 1) * kCols, lane, h);
    if (warp == 0)
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int e = 0; e < 8; ++e) out[lane * 8 + k * 256 + e] = h[k][e];
  }
}

}  // namespace

template <int kSync, bool kDefer = false>
void stream_with(const __nv_bfloat16* w, float* buf, unsigned* bar, unsigned* xt, unsigned seq, int layers,
                 int programs, int stride, int ahead, cudaStream_t stream) {
  const int bytes = kSlots * kChunkBytes + (kPieces + 1) * kSlots * 8;
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(stream_kernel<kSync, kDefer>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  stream_kernel<kSync, kDefer>
      <<<programs, kConsumers + 32, bytes, stream>>>(w, buf, bar, xt, seq, layers, stride, ahead);
}

// sync: as stream_phase's kSync; defer: its kDefer (sync 2 or 4 only); ahead: 8 KB copies the producer may
// have requested and not yet received, 1 to the ring's 24 (``xt``: int32 [5 * 2048], zeroed once; ``seq``
// new for each launch).
void launch_stream(const torch::Tensor& W, torch::Tensor& buf, torch::Tensor& bar, torch::Tensor& xt, int64_t layers,
                   int64_t programs, int64_t stride, int64_t sync, bool defer, int64_t ahead, int64_t seq) {
  TORCH_CHECK(W.is_cuda() && W.scalar_type() == torch::kBFloat16 && W.size(1) == kCols, "W: bf16 [rows, 1024] on CUDA");
  TORCH_CHECK(xt.scalar_type() == torch::kInt32 && xt.numel() >= 5 * 2048, "xt: int32 [5 * 2048]");
  TORCH_CHECK(!defer || sync == 2 || sync == 4, "defer: with sync 2 or 4 only");
  TORCH_CHECK(sync < 2 || sync == 3 || (programs * 8 >= kCols && programs * 8 <= 2048),
              "programs: 128 to 256 for tagged inputs "
              "(eight words each make up the next phase's 1,024), not ", programs);
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto* w = reinterpret_cast<const __nv_bfloat16*>(W.data_ptr<at::BFloat16>());
  auto* b = reinterpret_cast<unsigned*>(bar.data_ptr<int>());
  auto* x = reinterpret_cast<unsigned*>(xt.data_ptr<int>());
  const auto args = std::make_tuple(w, buf.data_ptr<float>(), b, x, static_cast<unsigned>(seq),
                                    static_cast<int>(layers), static_cast<int>(programs), static_cast<int>(stride),
                                    static_cast<int>(std::clamp<int64_t>(ahead, 1, kSlots * kPieces)), stream);
  switch (sync) {
    case 0: std::apply(stream_with<0>, args); break;
    case 1: std::apply(stream_with<1>, args); break;
    case 2: defer ? std::apply(stream_with<2, true>, args) : std::apply(stream_with<2>, args); break;
    case 3: std::apply(stream_with<3>, args); break;
    case 4: defer ? std::apply(stream_with<4, true>, args) : std::apply(stream_with<4>, args); break;
    default: TORCH_CHECK(false, "sync: 0 to 4, not ", sync);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The tagged design (``xt`` and ``seq`` as launch_stream's); early: weight rows issued before polling;
// poll: 0 each thread spins on its own words, 1 the block checks all after each poll.
void launch_tagged(const torch::Tensor& W, torch::Tensor& buf, torch::Tensor& xt, int64_t layers, int64_t programs,
                   int64_t stride, bool early, int64_t poll, int64_t seq) {
  TORCH_CHECK(W.is_cuda() && W.scalar_type() == torch::kBFloat16 && W.size(1) == kCols, "W: bf16 [rows, 1024] on CUDA");
  TORCH_CHECK(xt.scalar_type() == torch::kInt32 && xt.numel() >= 5 * 2048, "xt: int32 [5 * 2048]");
  TORCH_CHECK(programs * 8 >= kCols && programs * 8 <= 2048, "programs: 128 to 256 (eight words each make up the "
              "next phase's 1,024), not ", programs);
  TORCH_CHECK(poll == 0 || poll == 1, "poll: 0 or 1, not ", poll);
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto* w = reinterpret_cast<const __nv_bfloat16*>(W.data_ptr<at::BFloat16>());
  auto* x = reinterpret_cast<unsigned*>(xt.data_ptr<int>());
  const auto sq = static_cast<unsigned>(seq);
  const int l = static_cast<int>(layers), st = static_cast<int>(stride);
  float* out = buf.data_ptr<float>();
  if (early && poll == 0) tagged_kernel<true, 0><<<programs, 256, 0, stream>>>(w, out, x, sq, l, st);
  if (early && poll == 1) tagged_kernel<true, 1><<<programs, 256, 0, stream>>>(w, out, x, sq, l, st);
  if (!early && poll == 0) tagged_kernel<false, 0><<<programs, 256, 0, stream>>>(w, out, x, sq, l, st);
  if (!early && poll == 1) tagged_kernel<false, 1><<<programs, 256, 0, stream>>>(w, out, x, sq, l, st);
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

template <bool kSplitK>
cudaLaunchConfig_t edges_config(int programs, int cluster, cudaLaunchAttribute* attr, cudaStream_t stream) {
  if (cluster > 8)
    C10_CUDA_CHECK(cudaFuncSetAttribute(edges_kernel<kSplitK>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = cluster;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(programs);
  config.blockDim = dim3(256);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return config;
}

// How many clusters of ``cluster`` blocks of the edges design the device runs at once.
int64_t max_clusters(int64_t cluster, bool split_k) {
  cudaLaunchAttribute attr;
  int count = 0;
  if (split_k) {
    const auto config = edges_config<true>(cluster, cluster, &attr, nullptr);
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&count, edges_kernel<true>, &config));
  } else {
    const auto config = edges_config<false>(cluster, cluster, &attr, nullptr);
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&count, edges_kernel<false>, &config));
  }
  return count;
}

void launch_edges(const torch::Tensor& W, torch::Tensor& buf, torch::Tensor& sums, torch::Tensor& bar, int64_t layers,
                  int64_t programs, int64_t stride, int64_t cluster, int64_t mask, bool split_k) {
  TORCH_CHECK(W.is_cuda() && W.scalar_type() == torch::kBFloat16 && W.size(1) == kCols, "W: bf16 [rows, 1024] on CUDA");
  TORCH_CHECK(sums.scalar_type() == torch::kFloat32 && sums.numel() >= layers * kCols, "sums: float32 [layers * 1024]");
  TORCH_CHECK(programs % cluster == 0, "programs (", programs, ") must be a multiple of cluster (", cluster, ")");
  TORCH_CHECK((mask & 1) == 0 && (!split_k || (mask & 16) == 0), "mask: the first phase (and with split_k the fifth) "
              "read what every block wrote: they stay grid edges");
  TORCH_CHECK(max_clusters(cluster, split_k) * cluster >= programs, "programs: ", programs, " blocks in clusters of ",
              cluster, " do not all fit on the device at once");
  auto* w = reinterpret_cast<const __nv_bfloat16*>(W.data_ptr<at::BFloat16>());
  auto* b = reinterpret_cast<unsigned*>(bar.data_ptr<int>());
  cudaLaunchAttribute attr;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int l = static_cast<int>(layers), st = static_cast<int>(stride), mk = static_cast<int>(mask);
  if (split_k) {
    const auto config = edges_config<true>(programs, cluster, &attr, stream);
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, edges_kernel<true>, w, buf.data_ptr<float>(), sums.data_ptr<float>(),
                                      b, l, st, mk));
  } else {
    const auto config = edges_config<false>(programs, cluster, &attr, stream);
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, edges_kernel<false>, w, buf.data_ptr<float>(), sums.data_ptr<float>(),
                                      b, l, st, mk));
  }
}

int64_t split_layer_elements() { return kLayerElems; }

void launch_split(const torch::Tensor& W, const torch::Tensor& h0, torch::Tensor& sums, torch::Tensor& bar,
                  torch::Tensor& out, int64_t layers, std::optional<torch::Tensor> stamps, int64_t mode) {
  TORCH_CHECK(!stamps || stamps->numel() >= (layers + 1) * 16 + 2 * layers * kMlpBlocks,
              "stamps: int64 [(layers + 1) * 16 + 2 * layers * 88]");
  TORCH_CHECK(W.is_cuda() && W.scalar_type() == torch::kBFloat16 && W.numel() >= layers * kLayerElems,
              "W: bf16, layers * ", kLayerElems, " elements");
  TORCH_CHECK(sums.numel() >= (2 * layers + (mode == 3 ? kMlpBlocks : 0)) * kCols && h0.numel() >= kCols &&
                  out.numel() >= kCols,
              "sums: float32 [(2 * layers (+ 88 for mode 3)) * 1024], h0 and out [1024]");
  C10_CUDA_CHECK(cudaFuncSetAttribute(split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSplitSmem));
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = kRanks;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(kSplitBlocks);
  config.blockDim = dim3(kConsumers + 32);
  config.dynamicSmemBytes = kSplitSmem;
  config.stream = at::cuda::getCurrentCUDAStream();
  config.attrs = &attr;
  config.numAttrs = 1;
  int fit = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&fit, split_kernel, &config));
  TORCH_CHECK(fit * kRanks >= kSplitBlocks, "the split design needs ", kSplitBlocks, " blocks in clusters of ", kRanks,
              " resident at once; this device holds ", fit * kRanks);
  long long* stamps_ptr = stamps ? reinterpret_cast<long long*>(stamps->data_ptr<int64_t>()) : nullptr;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, split_kernel,
                                    reinterpret_cast<const __nv_bfloat16*>(W.data_ptr<at::BFloat16>()),
                                    h0.data_ptr<float>(), sums.data_ptr<float>(),
                                    reinterpret_cast<unsigned*>(bar.data_ptr<int>()), out.data_ptr<float>(),
                                    static_cast<int>(layers), stamps_ptr, static_cast<int>(mode)));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("launch", &launch, "the barriers design in CUDA C++");
  m.def("launch_stream", &launch_stream, "the stream design in CUDA C++ (no sync, barriers or tagged inputs)");
  m.def("launch_tagged", &launch_tagged, "the tagged design: inputs polled by their tags, no grid barrier");
  m.def("launch_edges", &launch_edges, "the barriers design with cluster edges and split-K");
  m.def("max_clusters", &max_clusters, "clusters of the edges design resident at once");
  m.def("launch_split", &launch_split, "the split design (Qwen3-0.6B bytes, two grid edges a layer)");
  m.def("split_layer_elements", &split_layer_elements, "bf16 elements of one layer of the split design");
}
