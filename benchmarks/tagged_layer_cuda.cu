// bench_tagged_layer.py's design: session 38's capped, tagged stream (layer_chain_cuda.cu) laid out as
// a Qwen3-0.6B decoder layer at 1,024 cached rows: its bytes (35.7 MB a layer) and its six hand-offs.
//
// One block of 8 consumer warps and a producer warp per multiprocessor (P blocks, 128 <= P <= 256).
// Every weight matrix and the K/V cache are packed as 32 KB chunks (16 rows x 1,024 columns; a row
// of 2,048 or 3,072 columns spans 2 or 3 chunks), 1,088 a layer. The producer copies its block's
// chunks in the order the consumers use them into a ring of 5 or 6 slots, with at most ``ahead``
// 8 KB copies requested and not yet landed. There is no barrier: every hand-off is a vector of
// tagged words (a bf16 value in the low half, the hand-off's 16-bit tag in the high half; attention's
// float32 partials as 64-bit words, value and 32-bit tag), polled until every tag is current. Each
// consumer thread issues the loads of all its words of a hand-off before it waits on any: one round
// trip a phase (polling a group of words at a time cost 26 dependent round trips a layer; session 39).
//
// For timing only, the hand-offs can be read once without their tags checked or not at all, the
// weights not copied (the chain of hand-offs alone), and each block's %globaltimer stamped at each
// phase's input and output (Stamps).
//
// A second extra warp, the prefetcher, may ask L2 for the block's next ``depth`` chunks past the
// producer's, so that HBM keeps streaming while the ring is full and the consumers wait for an input
// (prefetch mode 1: a 16-byte load of every 256-byte block with the L2::256B hint, at most two 8 KB
// pieces unanswered; mode 2: cp.async.bulk.prefetch.L2 of each 8 KB piece, bounded by ``depth`` only).
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
//
// That layout puts 14 chunks on the critical path (2 + 1 + 2 + 6 + 3: each phase's busiest block)
// where a block streams 9 at most. The spread layout (session 40) gives every phase to as many
// blocks as it has chunks, a chunk a task, so that the path is 9 chunks (2 + 1 + 1 + 3 + 2):
//   C  128 tasks: 16 rows x one half of the output projection's columns (its half of hand-off 2
//      polled) -> their float32 partial sums (64-bit words, 2 x 1,024)
//   D  every block polls both halves and forms h_mid = h + both (rounded to bf16) itself; 384
//      self-contained chunks (rows 2w and 2w + 1: gate and up row 8j + w), up to 3 a block
//   E  192 tasks: 16 rows x one third of down's columns -> float32 partial sums (3 x 1,024); the
//      next layer's A (every block) polls all three and forms h = h_mid + the three (rounded)
// Which block runs which C, D and E task is the caller's table (a row a block of 1 C, 3 D and 2 E
// tasks, -1: none), balanced over the blocks' whole layer. A third layout spreads only D (C and E as
// today's: 11 chunks on the path, no partial sums gathered).
#include <cuda_bf16.h>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

#include <type_traits>

#include "bulk_stream.cuh"

namespace {

using namespace bulk_stream;

constexpr int kCols = 1024;                 // a chunk's columns (and the hidden width)
constexpr int kChunkElems = 16 * kCols;     // 32 KB of bf16
constexpr int kChunkBytes = kChunkElems * 2;
constexpr int kPieces = 4;                  // 8 KB copies a chunk, each with its own mbarrier
constexpr int kMaxSlots = 6;                // the ring's slots: 5 or 6 (``slots``)
constexpr int kConsumers = kConsumerThreads;
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
  unsigned long long* hparts;    // spread layout: the output projection's partials, 2 x 1,024
  unsigned long long* eparts;    // spread layout: down's partials, 3 x 1,024
};

// Shared memory besides the ring (floats). The merge's partials, the attention output and act are
// polled in different phases (a consumer barrier between the merge and the output projection), so
// they share one buffer and leave room for a sixth slot.
struct Shared {
  float h[kCols], xn[kCols], hmid[kCols], qkv[512];
  union {
    float part[16 * kPart];
    float att[2048];
    float act[3072];
  };
  float scores[2][64], red[8], stats[2][2];
  float mma_red[2][8][16];  // rows_mma's warps' sums
};

__device__ __forceinline__ unsigned tag_of(unsigned seq, int layers, int layer, int handoff) {
  return 1u + (seq * 6u * layers + layer * 6u + handoff) % 65535u;
}

// x[i] / rms(x) into xn (1,024 values). Thread t reads only x[4t, 4t + 4), which poll_bf16 of 1,024
// words leaves to it (group t), so no barrier is needed before; the consumers synchronise inside.
__device__ __forceinline__ void normalise(const float* x, float* xn, float* red) {
  const int t = threadIdx.x;
  const float4 v = *reinterpret_cast<const float4*>(x + 4 * t);
  const float inv = inv_rms_1024(v, red, 1e-6f);
  *reinterpret_cast<float4*>(xn + 4 * t) = make_float4(v.x * inv, v.y * inv, v.z * inv, v.w * inv);
  consumers_sync();
}

// Timing only: thread 0's %globaltimer at ``event`` of ``layer`` (kEvents a layer: each phase's input
// polled, then its output handed on), one u64 a block (null: none).
constexpr int kEvents = 12;
struct Stamps {
  unsigned long long* at;
  int layer;
  __device__ __forceinline__ void operator()(int event) const {
    if (at == nullptr || threadIdx.x != 0) return;
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    at[(layer * kEvents + event) * gridDim.x + blockIdx.x] = now;
  }
};

// The ring, as the consumers see it.
struct Ring {
  const unsigned char* base;
  unsigned full0, empty0;
  int slots;
  int i;  // the next chunk
  bool math;  // false for timing only: the consumers wait for each chunk and release it, computing nothing
  float (*red)[8][16];  // tensor cores: each warp's partial row sums, two buffers used in turn (rows_mma)
  int buf;

  __device__ __forceinline__ const unsigned char* wait(int piece) const {
    const int slot = i % slots;
    mbar_wait(full0 + (slot * kPieces + piece) * 8, (i / slots) & 1);
    return base + slot * kChunkBytes;
  }
  __device__ __forceinline__ const unsigned char* wait_all() const {
    const unsigned char* chunk = nullptr;
    for (int p = 0; p < kPieces; ++p) chunk = wait(p);
    return chunk;
  }
  __device__ __forceinline__ void release() {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(empty0 + (i % slots) * 8);
    ++i;
  }
};

// A phase's input as rows_dot reads it: from shared memory, the lane's slice of chunk c's columns
// loaded for each chunk, or (HeldInput, phases whose chunks all read the same 1,024 values: q/k/v
// and gate/up) kept in registers for the whole phase, so that a chunk's shared-memory reads are its
// weights only.
struct SharedInput {
  static constexpr bool kMma = false;
  const float* x;
  __device__ __forceinline__ void slice(int c, float (&xv)[4][8]) const { lane_slice(x + c * kCols, threadIdx.x & 31, xv); }
};

struct HeldInput {
  static constexpr bool kMma = false;
  float xv[4][8];
  __device__ __forceinline__ void slice(int, float (&out)[4][8]) const {
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int e = 0; e < 8; ++e) out[k][e] = xv[k][e];
  }
};

// The input as tensor cores read it (kMma: rows_mma): the B fragments of the warp's 8 k-tiles of
// m16n8k16 (columns 128w .. 128w + 127 of chunk c's 1,024), x rounded to bf16 and the same in all 8
// columns of B. MmaShared converts them from x in shared memory for each chunk; MmaHeld holds them in
// registers for the phase.
__device__ __forceinline__ void mma_fragments(const float* x, unsigned (&b)[8][2]) {
  const float* p = x + (threadIdx.x >> 5) * 128 + 2 * (threadIdx.x & 3);
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const float2 lo = *reinterpret_cast<const float2*>(p + 16 * t);
    const float2 hi = *reinterpret_cast<const float2*>(p + 16 * t + 8);
    const __nv_bfloat162 blo = __floats2bfloat162_rn(lo.x, lo.y), bhi = __floats2bfloat162_rn(hi.x, hi.y);
    b[t][0] = *reinterpret_cast<const unsigned*>(&blo);
    b[t][1] = *reinterpret_cast<const unsigned*>(&bhi);
  }
}

struct MmaShared {
  static constexpr bool kMma = true;
  const float* x;
  __device__ __forceinline__ void fragments(int c, unsigned (&b)[8][2]) const { mma_fragments(x + c * kCols, b); }
};

struct MmaHeld {
  static constexpr bool kMma = true;
  unsigned bh[8][2];
  __device__ __forceinline__ void fragments(int, unsigned (&b)[8][2]) const {
#pragma unroll
    for (int t = 0; t < 8; ++t) b[t][0] = bh[t][0], b[t][1] = bh[t][1];
  }
};

// The thread that holds rows 2p and 2p + 1 of a 16-row task's sums (rows16) returns p, the others -1:
// lane 0 of warp p, or with tensor cores thread p.
template <class Input>
__device__ __forceinline__ int owner_pair(const Input&) {
  const int t = threadIdx.x;
  if constexpr (Input::kMma) return t < 8 ? t : -1;
  else return (t & 31) == 0 ? t >> 5 : -1;
}

// body(input) for the phase input x (1,024 values in shared memory), held in registers if kHeld (or,
// kMma, as tensor cores' fragments in registers).
template <bool kHeld, bool kMma = false, class Body>
__device__ __forceinline__ void with_input(const float* x, Body body) {
  if constexpr (kMma) {
    MmaHeld in;
    mma_fragments(x, in.bh);
    body(in);
  } else if constexpr (kHeld) {
    HeldInput in;
    lane_slice(x, threadIdx.x & 31, in.xv);
    body(in);
  } else {
    body(SharedInput{x});
  }
}

// The warp's two rows (2w, 2w+1) of a 16-row block spanning NC chunks, against the input (NC x 1,024
// values): every lane gets both sums (or, kIlp without kReduce, its partial sums).
template <int NC, bool kIlp, bool kReduce = true, class Input>
__device__ __forceinline__ void rows_dot(Ring& ring, const Input& input, float (&acc)[2]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  acc[0] = acc[1] = 0.f;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const unsigned char* chunk = ring.wait(warp / 2);  // the copy that holds the warp's rows
    if (!ring.math) {
      ring.release();
      continue;
    }
    float xv[4][8];
    input.slice(c, xv);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      uint4 w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        w[k] = *reinterpret_cast<const uint4*>(chunk + ((2 * warp + r) * kCols + lane * 8 + k * 256) * 2);
      // kIlp: the lane's partial sums, reduced over the warp once after the last chunk (not at all
      // without kReduce: the caller reduces them with others)
      acc[r] += kIlp ? lane_dot<4>(w, xv) : row_dot(w, xv);
    }
    ring.release();
  }
  if constexpr (kIlp && kReduce) warp_sums(acc);
}

// Tensor cores: the 16 rows of NC chunks (a row spans them) against the input, each chunk packed as
// m16n8k16 A fragments (warp w's 8 k-tiles, columns 128w .., lane by lane: 16 bytes a lane a tile;
// bench_tagged_layer.py's mma_packed). Each warp sums its columns in two chains of mma; the warps'
// sums meet in shared memory (ring.red, one buffer per call in turn, a consumer barrier), and thread p
// < 8 gets rows 2p and 2p + 1 (owner_pair).
template <int NC, class Input>
__device__ __forceinline__ void rows_mma(Ring& ring, const Input& input, float (&acc)[2]) {
  float d[2][4] = {};
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const unsigned char* chunk = ring.wait(threadIdx.x >> 6);  // the copy that holds the warp's fragments
    if (ring.math) {
      unsigned b[8][2];
      input.fragments(c, b);
      mma_chunk(d, chunk, b);
    }
    ring.release();
  }
  float (*red)[16] = ring.red[ring.buf];
  ring.buf ^= 1;
  meet_warp_sums(d, red, acc);
}

// A 16-row task's sums, as rows_dot (lane 0 of warp w: rows 2w, 2w + 1) or with tensor cores rows_mma
// (thread p: rows 2p, 2p + 1): owner_pair says which.
template <int NC, bool kIlp, class Input>
__device__ __forceinline__ void rows16(Ring& ring, const Input& input, float (&acc)[2]) {
  if constexpr (Input::kMma) rows_mma<NC>(ring, input, acc);
  else rows_dot<NC, kIlp>(ring, input, acc);
}

// Rows 16r .. 16r + 15 of a projection whose rows span NC chunks, against hand-off X (NC x 1,024
// words, polled into xs), each plus its row of ``residual``: handed on to XN (and, given ``out``,
// stored there unrounded).
template <int NC, bool kIlp, bool kMma>
__device__ __forceinline__ void project_residual(Ring& ring, const unsigned* X, unsigned tag_in, float* xs,
                                                 const float* residual, unsigned* XN, unsigned tag_out, int r,
                                                 float* out, unsigned limit, unsigned backoff, const Stamps& stamp,
                                                 int event) {
  poll_bf16<NC>(X, NC * kCols, tag_in, xs, limit, backoff);
  consumers_sync();
  stamp(event);
  float acc[2];
  using Input = std::conditional_t<kMma, MmaShared, SharedInput>;
  const Input input{xs};
  rows16<NC, kIlp>(ring, input, acc);
  const int p = owner_pair(input), row = 16 * r + 2 * p;
  if (p >= 0)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float v = residual[row + i] + acc[i];
      hand_bf16(XN, row + i, v, tag_out);
      if (out != nullptr) out[row + i] = v;
    }
  stamp(event + 1);
}

// Spread layout: the 16 rows of a one-chunk task against x (1,024 values in shared memory), handed on
// as float32 partial sums to dst[0 .. 16) (64-bit words).
template <bool kMma>
__device__ __forceinline__ void partial_rows(Ring& ring, const float* x, unsigned long long* dst, unsigned tag) {
  float acc[2];
  using Input = std::conditional_t<kMma, MmaShared, SharedInput>;
  const Input input{x};
  rows16<1, true>(ring, input, acc);
  if (const int p = owner_pair(input); p >= 0)
#pragma unroll
    for (int r = 0; r < 2; ++r) hand_f32(dst, 2 * p + r, acc[r], tag);
}

// One (KV head, split) task: 64 cached rows of K and V (the chunk's rows 0-7 and 8-15) against the
// head's two query rows (sh.qkv[0, 256)); each query head's unnormalised output, max and sum go to
// hand-off 1. Today's: each row's two scores reduced over the warp by their own shuffles, and P·V a
// thread a (head, dim) over all 64 rows (one bf16 load a row); ``quarters``: the warp's 16 scores
// reduced together (halving exchanges), and P·V each lane a pair of dims for both heads over 16 rows
// (one 32-bit load for four multiply-adds), the quarters summed through shared memory.
template <bool kIlp>
__device__ __forceinline__ void attend(Ring& ring, Shared& sh, unsigned long long* part, int task, unsigned tag,
                                       bool quarters) {
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const unsigned char* chunk = ring.wait_all();
  if (!ring.math) {
    unsigned long long* dst = part + (task * 2 + (t >> 7)) * kPart;
    hand_f32(dst, t & 127, 0.f, tag);
    if ((t & 127) < 2) hand_f32(dst, 128 + (t & 127), 1.f, tag);
    ring.release();
    return;
  }
  const __nv_bfloat16* K = reinterpret_cast<const __nv_bfloat16*>(chunk);
  const __nv_bfloat16* V = K + 64 * 128;
  const float4 q0 = *reinterpret_cast<const float4*>(sh.qkv + lane * 4);
  const float4 q1 = *reinterpret_cast<const float4*>(sh.qkv + 128 + lane * 4);
  const float scale = rsqrtf(128.f);
  if (quarters) {  // the warp's 16 sums (8 rows x 2 heads) reduced together: 16 shuffles, not 80
    float v[16];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const uint2 raw = *reinterpret_cast<const uint2*>(K + (8 * warp + r) * 128 + lane * 4);
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
      v[2 * r] = q0.x * a.x + q0.y * a.y + q0.z * b.x + q0.w * b.y;
      v[2 * r + 1] = q1.x * a.x + q1.y * a.y + q1.z * b.x + q1.w * b.y;
    }
    halving_sums16(v, lane);  // lane l: value l / 2's sum
    if ((lane & 1) == 0) sh.scores[lane & 2 ? 1 : 0][8 * warp + (lane >> 2)] = v[0] * scale;
  } else {
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
  if (quarters) {  // warp w: dims 64 (w % 2) .., rows 16 (w / 2) ..; lane: a pair of dims for both heads
    const int q = warp >> 1, dim = 64 * (warp & 1) + 2 * lane;
    float o4[2][2] = {};
#pragma unroll
    for (int j = 16 * q; j < 16 * q + 16; ++j) {
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(V + j * 128 + dim));
#pragma unroll
      for (int hd = 0; hd < 2; ++hd) {
        o4[hd][0] = fmaf(sh.scores[hd][j], v.x, o4[hd][0]);
        o4[hd][1] = fmaf(sh.scores[hd][j], v.y, o4[hd][1]);
      }
    }
    float* red = sh.xn;  // [quarter][head][dim]: free from A's end to D's norm
#pragma unroll
    for (int hd = 0; hd < 2; ++hd)
      *reinterpret_cast<float2*>(red + (q * 2 + hd) * 128 + dim) = make_float2(o4[hd][0], o4[hd][1]);
    consumers_sync();
    o = (red[head * 128 + d] + red[(2 + head) * 128 + d]) + (red[(4 + head) * 128 + d] + red[(6 + head) * 128 + d]);
  } else if constexpr (kIlp) {  // four independent sums
    float o4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 64; ++j) o4[j % 4] = fmaf(sh.scores[head][j], __bfloat162float(V[j * 128 + d]), o4[j % 4]);
    o = (o4[0] + o4[1]) + (o4[2] + o4[3]);
  } else {
#pragma unroll 8
    for (int j = 0; j < 64; ++j) o = fmaf(sh.scores[head][j], __bfloat162float(V[j * 128 + d]), o);
  }
  unsigned long long* dst = part + (task * 2 + head) * kPart;
  hand_f32(dst, d, o, tag);
  if (d < 2) hand_f32(dst, 128 + d, sh.stats[head][d], tag);
  ring.release();
}

// A block's C, D and E work, from the caller's table: today's layout, a row of up to 4 gate/up pairs;
// the spread layout, a row of 1 C task, 3 D chunks and 2 E tasks; only D spread, up to 5 D chunks in
// columns 1-5 (-1: none).
constexpr int kPairsWidth = 4, kTasksWidth = 6;
struct Work {
  int d[5], n_d;  // gate/up pairs, or (spread) D chunks
  int c, e[2], n_e;  // spread only: the C task, the E tasks
};

// The layouts: today's; C, D and E spread a chunk a task; only D spread (C and E as today's, D's chunks
// as the spread layout's, from its table).
constexpr int kLayoutToday = 0, kLayoutSpread = 1, kLayoutSpreadD = 2;

template <int kLayout>
__device__ __forceinline__ Work block_work(const int* table, int b) {
  Work w{{}, 0, -1, {}, 0};
  if constexpr (kLayout == kLayoutSpread) {
    const int* row = table + kTasksWidth * b;
    w.c = row[0];
    for (int k = 1; k < 4 && row[k] >= 0; ++k) w.d[w.n_d++] = row[k];
    for (int k = 4; k < 6 && row[k] >= 0; ++k) w.e[w.n_e++] = row[k];
  } else if constexpr (kLayout == kLayoutSpreadD) {
    const int* row = table + kTasksWidth * b;
    for (int k = 1; k < 6 && row[k] >= 0; ++k) w.d[w.n_d++] = row[k];
  } else {
    const int* row = table + kPairsWidth * b;
    for (int k = 0; k < 4 && row[k] >= 0; ++k) w.d[w.n_d++] = row[k];
  }
  return w;
}

// The block's chunks of a layer, in the order its consumers use them (ids into the layer's 1,088): A
// chunks b, b + P, ...; B task P - 1 - b; then today: C rows 16 * (b / 2) for even b < 128 (both
// halves), D pairs (gate, then up), E rows 16 * (b / 2) for odd b < 128 (three thirds); spread: its
// C task, D chunks and E tasks (a chunk each). Returns how many (<= 16).
template <int kLayout>
__device__ __forceinline__ int block_chunks(int b, int P, const Work& w, int (&ids)[16]) {
  const int task = P - 1 - b;
  int n = 0;
  for (int a = b; a < kA; a += P) ids[n++] = a;
  if (task < kB) ids[n++] = kB0 + task;
  if constexpr (kLayout == kLayoutSpread) {
    if (w.c >= 0) ids[n++] = kC0 + w.c;
    for (int k = 0; k < w.n_d; ++k) ids[n++] = kD0 + w.d[k];
    for (int k = 0; k < w.n_e; ++k) ids[n++] = kE0 + w.e[k];
    return n;
  }
  if (b < 128 && b % 2 == 0) ids[n++] = kC0 + b, ids[n++] = kC0 + b + 1;
  for (int k = 0; k < w.n_d; ++k)
    if constexpr (kLayout == kLayoutSpreadD) ids[n++] = kD0 + w.d[k];
    else ids[n++] = kD0 + 2 * w.d[k], ids[n++] = kD0 + 2 * w.d[k] + 1;
  if (b < 128 && b % 2 == 1) {
    const int r = b / 2;
    ids[n++] = kE0 + 3 * r, ids[n++] = kE0 + 3 * r + 1, ids[n++] = kE0 + 3 * r + 2;
  }
  return n;
}

// Spread layout: kN partial vectors of 1,024 float32 words (64-bit, ``tag``) polled into ``scratch``
// and summed with ``base``, every value rounded to bf16 into ``dst`` (unrounded into ``out`` too, if
// given). Thread t forms values 4t .. 4t + 3 (normalise's share); the consumers synchronise after
// the poll only.
template <int kN>
__device__ __forceinline__ void gather_parts(const unsigned long long* parts, unsigned tag, float* scratch,
                                             const float* base, float* dst, float* out, unsigned limit,
                                             unsigned backoff) {
  poll<F32Group, 2 * kN>(kN * kCols / 2, [parts](int g) { return parts + 2 * g; }, scratch, tag, limit, backoff);
  consumers_sync();
  const int t = threadIdx.x;
  float4 v = *reinterpret_cast<const float4*>(base + 4 * t);
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const float4 p = *reinterpret_cast<const float4*>(scratch + k * kCols + 4 * t);
    v.x += p.x, v.y += p.y, v.z += p.z, v.w += p.w;
  }
  if (out != nullptr) *reinterpret_cast<float4*>(out + 4 * t) = v;
  const auto round = [](float x) { return __bfloat162float(__float2bfloat16_rn(x)); };
  *reinterpret_cast<float4*>(dst + 4 * t) = make_float4(round(v.x), round(v.y), round(v.z), round(v.w));
}

// A 16-byte load that asks L2 for the whole 256-byte block around it (not kept in L1).
__device__ __forceinline__ unsigned touch_256(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v.x;
}

__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// The prefetcher warp: chunk j of the block's sequence once j < the producer's next + depth.
__device__ void prefetch_ahead(const __nv_bfloat16* W, const int (&ids)[16], int n, int layers, int depth, int mode,
                               const volatile int* producer_next) {
  const int lane = threadIdx.x & 31;
  unsigned sink = 0, pending0 = 0, pending1 = 0;
  for (int j = 0; j < layers * n; ++j) {
    int next;
    while (j >= (next = *producer_next) + depth) __nanosleep(64);
    if (j < next) continue;  // the producer has asked for it already
    const char* chunk = reinterpret_cast<const char*>(W + (static_cast<long>(j / n) * kLayerChunks + ids[j % n]) *
                                                              kChunkElems);
    for (int p = 0; p < kPieces; ++p) {
      const char* piece = chunk + p * (kChunkBytes / kPieces);
      if (mode == 2) {
        if (lane == 0) prefetch_l2(piece, kChunkBytes / kPieces);
      } else {
        // waits for the piece before last (at most two unanswered); volatile, so before the next load
        asm volatile("xor.b32 %0, %0, %1;" : "+r"(sink) : "r"(pending0));
        pending0 = pending1;
        pending1 = touch_256(piece + lane * 256);
      }
    }
  }
  if ((sink ^ pending0 ^ pending1) == 0x9e3779b9u && depth < 0) asm volatile("trap;");  // keeps the loads
}

// kIlp: the consumers' sums in independent parts, reduced over the warp once a row (rows_dot, attend);
// kHeld: q/k/v's and gate/up's input held in registers for the phase (HeldInput); kLayout: today's,
// the spread layout (C, D and E a chunk a task, ``table`` a row of tasks a block) or only D spread.
// kMma: the rows of q/k/v, the output projection, gate/up and down by tensor cores (rows_mma).
template <bool kIlp, bool kHeld, int kLayout, bool kMma>
__global__ void __launch_bounds__(kConsumers + 64, 1)
    tagged_layer_kernel(const __nv_bfloat16* W, const float* h0, Handoffs ho, float* out, const int* table,
                        unsigned seq, int layers, int slots, int ahead, int depth, int prefetch, int check,
                        bool copies, bool math, bool quarters, unsigned backoff, unsigned long long* stamps) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(16) Shared sh;
  __shared__ int producer_next;  // the producer's next chunk, for the prefetcher
  const int b = blockIdx.x, P = gridDim.x;
  const unsigned full0 = smem_addr(smem + slots * kChunkBytes);
  const unsigned empty0 = full0 + slots * kPieces * 8;
  // This block's work (block_chunks); merge b (< 16); C, D and E as the table gives them.
  const int task = P - 1 - b;
  constexpr bool kSpread = kLayout == kLayoutSpread;  // C and E split into partial sums
  const Work work = block_work<kLayout>(table, b);
  const bool has_b = task < kB, has_m = b < 16;
  const bool has_c = kSpread ? work.c >= 0 : b < 128 && b % 2 == 0;
  const bool has_e = kSpread ? work.n_e > 0 : b < 128 && b % 2 == 1;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      for (int p = 0; p < kPieces; ++p) mbar_init(full0 + (s * kPieces + p) * 8, 1);
      mbar_init(empty0 + s * 8, 8);  // one per consumer warp
    }
    mbar_init_fence();
    producer_next = 0;
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers + 32) {  // the prefetcher warp
    if (prefetch == 0) return;
    int ids[16];
    const int n = block_chunks<kLayout>(b, P, work, ids);
    prefetch_ahead(W, ids, n, layers, depth, prefetch, &producer_next);
    return;
  }
  if (threadIdx.x >= kConsumers) {  // the producer: one thread copies the block's chunks in order
    if (threadIdx.x != kConsumers) return;
    const unsigned long long policy = evict_first_policy();
    int ids[16];
    const int n = block_chunks<kLayout>(b, P, work, ids);
    volatile int* next = &producer_next;
    int i = 0;
    for (int layer = 0; layer < layers; ++layer)
      for (int k = 0; k < n; ++k, ++i) {
        const int slot = i % slots;
        mbar_wait(empty0 + slot * 8, ((i / slots) & 1) ^ 1);
        const __nv_bfloat16* src = W + (static_cast<long>(layer) * kLayerChunks + ids[k]) * kChunkElems;
        for (int p = 0; p < kPieces; ++p) {
          wait_landed<kPieces>(full0, i * kPieces + p - ahead, slots);  // at most ``ahead`` in flight
          const unsigned full = full0 + (slot * kPieces + p) * 8;
          if (!copies) {  // timing only: the slot "lands" with what it held
            mbar_arrive(full);
            continue;
          }
          expect_bytes(full, kChunkBytes / kPieces);
          bulk_copy(smem + slot * kChunkBytes + p * (kChunkBytes / kPieces), src + p * (kChunkElems / kPieces),
                    kChunkBytes / kPieces, full, policy);
        }
        *next = i + 1;
      }
    return;
  }
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const unsigned limit = check == 1 ? kSpinLimit : check == 0 ? 1u : 0u;  // poll's limits
  Ring ring{smem, full0, empty0, slots, 0, math, sh.mma_red, 0};
  float acc[2], acc2[2];
  for (int layer = 0; layer < layers; ++layer) {
    const auto tag = [&](int handoff) { return tag_of(seq, layers, layer, handoff); };
    const Stamps stamp{stamps, layer};
    // A: h, normalised; q/k/v rows
    if (layer == 0) {
      *reinterpret_cast<float4*>(sh.h + 4 * t) = *reinterpret_cast<const float4*>(h0 + 4 * t);
    } else {
      if constexpr (kSpread) {  // h = h_mid + down's three partials
        consumers_sync();  // the last E task has read sh.act (gather's scratch)
        gather_parts<3>(ho.eparts, tag_of(seq, layers, layer - 1, 5), sh.act, sh.hmid, sh.h, nullptr, limit, backoff);
      } else {
        poll_bf16<1>(ho.h, kCols, tag_of(seq, layers, layer - 1, 5), sh.h, limit, backoff);
      }
    }
    normalise(sh.h, sh.xn, sh.red);
    stamp(0);
    with_input<kHeld, kMma>(sh.xn, [&](const auto& input) {
      const int p = owner_pair(input);
      for (int a = b; a < kA; a += P) {
        rows16<1, kIlp>(ring, input, acc);
        if (p >= 0)
#pragma unroll
          for (int r = 0; r < 2; ++r) hand_bf16(ho.qkv, 16 * a + 2 * p + r, acc[r], tag(0));
      }
    });
    stamp(1);
    // B: the head's q rows (and, as the real layer's dependency, its k and v rows)
    if (has_b) {
      const int head = task / 16;
      const unsigned* q = ho.qkv + 256 * head;  // its 2 q rows, then its k and v rows
      const unsigned* k = ho.qkv + 2048 + 128 * head;
      const unsigned* v = ho.qkv + 3072 + 128 * head;
      const auto src = [=](int g) { return g < 64 ? q + 4 * g : g < 96 ? k + 4 * (g - 64) : v + 4 * (g - 96); };
      poll<Bf16Group, 1>(128, src, sh.qkv, tag(0), limit, backoff);
      consumers_sync();
      stamp(2);
      attend<kIlp>(ring, sh, ho.part, task, tag(1), quarters);
      stamp(3);
    }
    // M: query head b's 16 partials merged
    if (has_m) {
      const int kv = b / 2, q = b % 2;
      const unsigned long long* part = ho.part;
      const auto src = [=](int g) {  // group g: split g / 65's words 2 (g % 65), +1
        return part + ((kv * 16 + g / (kPart / 2)) * 2 + q) * kPart + 2 * (g % (kPart / 2));
      };
      poll<F32Group, 5>(16 * kPart / 2, src, sh.part, tag(1), limit, backoff);
      consumers_sync();
      stamp(4);
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
      stamp(5);
      consumers_sync();  // the partials are read before sh.att (the same buffer) is written
    }
    if constexpr (kSpread) {
      // C: 16 rows x one half of the output projection -> their partial sums
      if (has_c) {
        const int half = work.c % 2;
        poll_bf16<1>(ho.att + half * kCols, kCols, tag(2), sh.att, limit, backoff);
        consumers_sync();
        stamp(6);
        partial_rows<kMma>(ring, sh.att, ho.hparts + half * kCols + 16 * (work.c / 2), tag(3));
        stamp(7);
        consumers_sync();  // sh.att is read before gather_parts (the same buffer) writes
      }
      // D: h_mid = h + both partials, normalised; each chunk's gate and up rows, silu(gate) * up
      gather_parts<2>(ho.hparts, tag(3), sh.part, sh.h, sh.hmid, nullptr, limit, backoff);
    } else {
      // C: 16 rows of the output projection, plus h
      if (has_c)
        project_residual<2, kIlp, kMma>(ring, ho.att, tag(2), sh.att, sh.h, ho.hmid, tag(3), b / 2, nullptr, limit,
                                        backoff, stamp, 6);
      // D: h_mid normalised; gate and up rows, silu(gate) * up
      poll_bf16<1>(ho.hmid, kCols, tag(3), sh.hmid, limit, backoff);
    }
    normalise(sh.hmid, sh.xn, sh.red);
    stamp(8);
    with_input<kHeld, kMma>(sh.xn, [&](const auto& input) {
      const int p = owner_pair(input);
      for (int k = 0; k < work.n_d; ++k) {
        const int j = work.d[k];
        if constexpr (kLayout != kLayoutToday) {  // a chunk: rows 2p and 2p + 1, gate and up row 8j + p
          rows16<1, true>(ring, input, acc);
          if (p >= 0) hand_bf16(ho.act, 8 * j + p, acc[0] / (1.f + expf(-acc[0])) * acc[1], tag(4));
          continue;
        }
        if constexpr (kMma) {
          rows16<1, true>(ring, input, acc);
          rows16<1, true>(ring, input, acc2);
        } else if constexpr (kIlp) {  // gate's and up's partial sums, then all four reductions at once
          rows_dot<1, true, false>(ring, input, acc);
          rows_dot<1, true, false>(ring, input, acc2);
          float sums[4] = {acc[0], acc[1], acc2[0], acc2[1]};
          warp_sums(sums);
          acc[0] = sums[0], acc[1] = sums[1], acc2[0] = sums[2], acc2[1] = sums[3];
        } else {
          rows_dot<1, false>(ring, input, acc);
          rows_dot<1, false>(ring, input, acc2);
        }
        if (p >= 0)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float silu = acc[r] / (1.f + expf(-acc[r]));
            hand_bf16(ho.act, 16 * j + 2 * p + r, silu * acc2[r], tag(4));
          }
      }
    });
    stamp(9);
    if constexpr (kSpread) {
      // E: each task's 16 rows x one third of down -> their partial sums
      if (has_e) {
        poll_bf16<3>(ho.act, 3 * kCols, tag(4), sh.act, limit, backoff);
        consumers_sync();
        stamp(10);
        for (int k = 0; k < work.n_e; ++k) {
          const int third = work.e[k] % 3;
          partial_rows<kMma>(ring, sh.act + third * kCols, ho.eparts + third * kCols + 16 * (work.e[k] / 3), tag(5));
        }
        stamp(11);
      }
    } else {
      // E: 16 rows of the down projection, plus h_mid
      if (has_e)
        project_residual<3, kIlp, kMma>(ring, ho.act, tag(4), sh.act, sh.hmid, ho.h, tag(5), b / 2, out, limit, backoff,
                                        stamp, 10);
    }
  }
  if constexpr (kSpread) {  // the check's ``out``: the last layer's h_mid + down's partials, unrounded
    if (b == 0) {
      consumers_sync();
      gather_parts<3>(ho.eparts, tag_of(seq, layers, layers - 1, 5), sh.act, sh.hmid, sh.h, out, limit, backoff);
    }
  }
}

}  // namespace

int64_t layer_chunks() { return kLayerChunks; }

// W: bf16 [layers * 1,088, 16, 1,024] (bench_tagged_layer.py packs it); h0: float32 [1,024]; words:
// int32 [>= 4096 + 2048 + 1024 + 3072 + 1024] (zeroed once); part: int64 [128 * 2 * 130 + 5 * 1,024]
// (the attention partials, then the spread layout's); out: float32 [1,024]; table: int32 [programs,
// 4], each block's gate/up pairs (-1: no more; every pair once), or for the spread layouts [programs,
// 6], each block's C task, D chunks and E tasks (every task once; only D: C and E -1); seq: new for
// each launch; slots: the ring's, 5 or 6; ahead: 8 KB copies in flight a block, 1 to
// 4 * slots (the whole ring: no cap); prefetch: 0 (none),
// 1 (loads with the L2::256B hint) or 2 (bulk L2 prefetches), up to ``depth`` chunks past the producer's;
// check: 1 polls every hand-off until its tags are current; for timing only (races), 0 reads it once
// without checking them and -1 does not read it at all; copies: false copies no weights (timing only:
// the consumers compute on whatever the ring holds); math: false computes nothing either (timing only:
// the hand-offs and the ring's waits alone; hand-offs carry zeros); quarters: attention's P·V by
// quarters of the rows (attend); backoff: ns between polls of a group (0: none);
// stamps: int64 [layers * 12 * programs] of %globaltimer stamps (Stamps), or an empty tensor for none;
// ilp: the consumers' sums in independent parts; held: q/k/v's and gate/up's input in registers;
// layout: 0 today's, 1 spread, 2 only D spread (the spread layouts' sums independent: ilp); mma: the
// projections' rows by tensor cores (W packed for them; ilp, and their input held as fragments: not
// held).
template <bool kIlp, bool kHeld, bool kMma = false>
auto kernel_for(int layout) {
  if constexpr (kIlp)
    return layout == kLayoutSpread    ? tagged_layer_kernel<true, kHeld, kLayoutSpread, kMma>
           : layout == kLayoutSpreadD ? tagged_layer_kernel<true, kHeld, kLayoutSpreadD, kMma>
                                      : tagged_layer_kernel<true, kHeld, kLayoutToday, kMma>;
  else return tagged_layer_kernel<false, kHeld, kLayoutToday, false>;
}

void launch(const torch::Tensor& W, const torch::Tensor& h0, torch::Tensor& words, torch::Tensor& part,
            torch::Tensor& out, const torch::Tensor& table, int64_t layers, int64_t programs, int64_t seq,
            int64_t slots, int64_t ahead, int64_t prefetch, int64_t depth, int64_t check, bool copies, bool math,
            bool quarters, int64_t backoff,
            torch::Tensor& stamps, bool ilp, bool held, int64_t layout, bool mma) {
  TORCH_CHECK(W.is_cuda() && W.scalar_type() == torch::kBFloat16 && W.numel() >= layers * kLayerChunks * kChunkElems,
              "W: bf16, layers * ", kLayerChunks, " chunks of ", kChunkElems);
  TORCH_CHECK(h0.scalar_type() == torch::kFloat32 && h0.numel() >= kCols, "h0: float32 [1024]");
  TORCH_CHECK(words.scalar_type() == torch::kInt32 && words.numel() >= 11264, "words: int32 [11264]");
  TORCH_CHECK(part.scalar_type() == torch::kInt64 && part.numel() >= kB * 2 * kPart + 5 * kCols,
              "part: int64 [128 * 2 * 130 + 5 * 1024]");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.numel() >= kCols, "out: float32 [1024]");
  TORCH_CHECK(programs >= 128 && programs <= 256, "programs: 128 to 256, not ", programs);
  TORCH_CHECK(layout >= kLayoutToday && layout <= kLayoutSpreadD, "layout: 0, 1 or 2, not ", layout);
  const int width = layout == kLayoutToday ? kPairsWidth : kTasksWidth;
  TORCH_CHECK(table.is_cuda() && table.scalar_type() == torch::kInt32 && table.numel() == programs * width,
              "table: int32 [programs, ", width, "] on CUDA");
  TORCH_CHECK(layout == kLayoutToday || ilp, "layout: the spread layouts' sums are independent (ilp)");
  TORCH_CHECK(slots == 5 || slots == kMaxSlots, "slots: 5 or 6, not ", slots);
  TORCH_CHECK(ahead >= 1 && ahead <= slots * kPieces, "ahead: 1 to ", slots * kPieces, ", not ", ahead);
  TORCH_CHECK(check >= -1 && check <= 1, "check: -1, 0 or 1, not ", check);
  TORCH_CHECK(backoff >= 0 && backoff <= 10000, "backoff: 0 to 10,000 ns, not ", backoff);
  TORCH_CHECK(stamps.numel() == 0 || (stamps.is_cuda() && stamps.scalar_type() == torch::kInt64 &&
                                      stamps.numel() >= layers * kEvents * programs),
              "stamps: empty, or int64 [layers * 12 * programs] on CUDA");
  TORCH_CHECK(prefetch >= 0 && prefetch <= 2, "prefetch: 0, 1 or 2, not ", prefetch);
  TORCH_CHECK(prefetch == 0 || (depth >= 1 && depth <= 64), "depth: 1 to 64 chunks, not ", depth);
  auto* w = reinterpret_cast<unsigned*>(words.data_ptr<int>());
  auto* parts = reinterpret_cast<unsigned long long*>(part.data_ptr<int64_t>());
  const Handoffs ho{w, parts, w + 4096, w + 6144, w + 7168, w + 10240, parts + kB * 2 * kPart,
                    parts + kB * 2 * kPart + 2 * kCols};
  const int bytes = slots * kChunkBytes + (kPieces + 1) * slots * 8;
  TORCH_CHECK(!mma || (ilp && !held), "mma: its sums are independent (ilp) and its input not held");
  const auto kernel = mma   ? kernel_for<true, false, true>(layout)
                      : ilp ? (held ? kernel_for<true, true>(layout) : kernel_for<true, false>(layout))
                            : (held ? kernel_for<false, true>(layout) : kernel_for<false, false>(layout));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  kernel<<<programs, kConsumers + 64, bytes, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(W.data_ptr<at::BFloat16>()), h0.data_ptr<float>(), ho,
      out.data_ptr<float>(), table.data_ptr<int>(), static_cast<unsigned>(seq), static_cast<int>(layers),
      static_cast<int>(slots), static_cast<int>(ahead), static_cast<int>(depth), static_cast<int>(prefetch),
      static_cast<int>(check), copies, math, quarters, static_cast<unsigned>(backoff),
      stamps.numel() ? reinterpret_cast<unsigned long long*>(stamps.data_ptr<int64_t>()) : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("launch", &launch, "a Qwen3-0.6B-shaped layer as a capped, tagged stream");
  m.def("layer_chunks", &layer_chunks, "32 KB chunks a layer");
}
