// Every decoder layer of a batch-1 decode step in one launch, as a stream of tagged hand-offs
// (compaction_gym/engine/fast/tagged.py; docs/fast-path.md, "Tagged hand-offs"). Qwen3-0.6B's shape
// only: hidden 1,024, 16 query and 8 KV heads of 128, intermediate 3,072, q/k norm, no biases, bf16.
//
// One block of 8 consumer warps and a producer warp per multiprocessor (P blocks, 128 <= P <= 256).
// Every weight matrix is packed as 32 KB chunks (16 rows x 1,024 columns, as tensor cores' m16n8k16 A
// fragments: tagged.py's pack_weights), 960 a layer; attention's chunks are 64 cached K rows and
// their 64 V rows, copied from the slot cache. The producer copies its block's chunks in the order
// the consumers use them into a ring of 5 slots, with at most two 8 KB copies requested and not yet
// landed. There is no grid barrier: every hand-off is a vector of tagged words (a bf16 value in the low
// half, the hand-off's 16-bit tag in the high half; attention's float32 partials as 64-bit words,
// value and 32-bit tag), polled until every tag is current. The tags of a launch come from a counter
// in device memory that the last block out advances, so that a captured graph replays.
//
// A layer (HF's roundings: each projection's output, the residual and SiLU·mul rounded to bf16; an
// RMS norm rounds x / rms(x) before its weight multiplies it):
//   A  every block: the residual h (layer 0: the embedding row), in_norm; its q/k/v row chunks
//      (256, block a % P) -> hand-off 0: q/k/v (4,096 words)
//   B  128 tasks, one per (KV head, split of the cached rows): the head's 2 q rows and its k and v
//      rows, q/k norm and RoPE (the task that holds the new row stores its K/V into the cache and
//      patches them into the chunk it copied; split 0 records the queries); flash-decode with β over
//      its rows, 64 a chunk -> hand-off 1: each query head's unnormalised output, max and sum
//   M  16 blocks, one per query head: the 16 partials merged -> hand-off 2: attention (2,048)
//   C  64 blocks: 16 rows of the output projection (2 chunks) + h -> hand-off 3: h_mid (1,024)
//   D  every block: h_mid, post_norm; self-contained chunks of 8 gate and 8 up rows (384, ``table``:
//      up to 5 a block), silu(gate) * up -> hand-off 4: act (3,072)
//   E  64 blocks: 16 rows of the down projection (3 chunks) + h_mid -> hand-off 5: h (the last
//      layer's also to ``out``)
//
// Each hand-off's buffer is reused by every layer, and every word of it is written in every layer.
// A word is written again only after all its readers have read it, because each rewrite depends on
// work those readers do after reading. Every phase's output is read whole by the next phase, and
// every block has q/k/v chunks (P <= 256), so the next layer's C needs every block's A of that layer:
//   h_mid (D, every block), act (E), h (A, every block): rewritten by the next layer's C, D and E,
//     after every block's next A, which each block starts after its reads;
//   q/k/v (B): rewritten by the next layer's A, after h <- act <- h_mid <- att <- every partial,
//     each written after its task's reads;
//   partials (M): rewritten by the next B, after q/k/v <- h <- ... <- att, every merge's output;
//   att (C): rewritten by the next M, after its partials <- q/k/v <- h <- act <- every C block's
//     h_mid.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

#include "bulk_stream.cuh"

namespace {

using namespace bulk_stream;

constexpr int kCols = 1024;  // hidden width, and a chunk's columns
constexpr int kHeadDim = 128, kKvHeads = 8, kQHeads = 16;
constexpr int kChunkElems = 16 * kCols;  // 32 KB of bf16
constexpr int kChunkBytes = 2 * kChunkElems;
constexpr int kPieces = 4;  // 8 KB copies a chunk, each with its own mbarrier
constexpr int kSlots = 5;
constexpr int kAhead = 2;  // 8 KB copies a block may have requested and not yet received
constexpr int kConsumers = kConsumerThreads;
constexpr int kA = 256, kC = 128, kD = 384, kE = 192;  // weight chunks a layer, by phase
constexpr int kLayerChunks = kA + kC + kD + kE;       // 960
constexpr int kC0 = kA, kD0 = kC0 + kC, kE0 = kD0 + kD;
constexpr int kSplits = 16, kTasks = kKvHeads * kSplits;  // attention's (KV head, split) tasks
constexpr int kKeys = 64;                                 // cached rows a chunk
constexpr int kPart = 130;                                // a partial: 128 outputs, max, sum
constexpr int kTableWidth = 5;                            // D chunks a block, at most
constexpr int kNormElems = 2 * kCols + 2 * kHeadDim;      // a layer's norm weights: in, post, q, k

struct Handoffs {
  unsigned* qkv;             // 4,096
  unsigned long long* part;  // 128 tasks x 2 heads x kPart
  unsigned* att;             // 2,048
  unsigned* hmid;            // 1,024
  unsigned* act;             // 3,072
  unsigned* h;               // 1,024
};

struct Params {
  const __nv_bfloat16* W;      // [layers, 960, 16, 1,024], packed
  const __nv_bfloat16* norms;  // [layers, kNormElems]
  const __nv_bfloat16* cos;    // [positions, 64]
  const __nv_bfloat16* sin;
  __nv_bfloat16* k_cache;  // [slots, layers, 8, capacity, 128]: rows contiguous
  __nv_bfloat16* v_cache;
  const float* beta;  // [slots, layers, 8, capacity]
  long long k_slot, k_layer, k_head, v_slot, v_layer, v_head, b_slot, b_layer, b_head;  // strides
  const int64_t *pos, *slot, *row, *len;  // the step's inputs, [1] each
  const __nv_bfloat16* h0;                  // the embedding row
  __nv_bfloat16* out;                       // the last layer's residual
  __nv_bfloat16* q_out;                     // [layers, ., 16, 128] (stride q_layer) or null
  long long q_layer;
  const int* table;  // [P, 5]: each block's D chunks (-1: none)
  Handoffs ho;
  unsigned* state;  // [0] launches so far (the tags' sequence), [1] blocks done, [2] polls that gave up
  int layers;
  float eps, scale;
};

struct Shared {
  float h[kCols], xn[kCols], hmid[kCols], qkv[512];
  union {
    float part[16 * kPart];
    float att[2048];
    float act[3072];
  };
  float scores[2][kKeys], red[8], stats[2][2], alpha[2];
  float mma_red[2][8][16];  // rows_mma's warps' sums
};

// Hand-off ``handoff`` (0-5) of ``layer`` in launch ``seq``: tags 1 .. 65,535 (0 is a zeroed word's),
// periodic in ``seq`` without overflow (the
// benchmark's 32-bit form wraps after ~25M launches; the engine's must not).
__device__ __forceinline__ unsigned tag_of(unsigned seq, int layers, int layer, int handoff) {
  const unsigned long long period = 65535;
  return 1u + static_cast<unsigned>(((seq % period) * (6ull * layers % period) + 6ull * layer + handoff) % period);
}

__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Four bf16 values of a norm's weight (8 bytes), as float32.
__device__ __forceinline__ float4 load_bf16x4(const __nv_bfloat16* p) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

// HF's RMSNorm of x (1,024 values) into xn: bf16(w * bf16(x / rms(x))); thread t's weights w4 are
// those of values 4t .. 4t + 3, the only values of x it reads (poll_bf16 of 1,024 words leaves them
// to it), so no barrier is needed before; the consumers synchronise inside.
__device__ __forceinline__ void normalise(const float* x, float* xn, float* red, float4 w4, float eps) {
  const int t = threadIdx.x;
  const float4 v = *reinterpret_cast<const float4*>(x + 4 * t);
  const float inv = inv_rms_1024(v, red, eps);
  *reinterpret_cast<float4*>(xn + 4 * t) = make_float4(bf16r(w4.x * bf16r(v.x * inv)), bf16r(w4.y * bf16r(v.y * inv)),
                                                       bf16r(w4.z * bf16r(v.z * inv)), bf16r(w4.w * bf16r(v.w * inv)));
  consumers_sync();
}

struct Ring {
  const unsigned char* base;
  unsigned full0, empty0;
  int i;                // the next chunk
  float (*red)[8][16];  // each warp's partial row sums, two buffers used in turn (rows_mma)
  int buf;

  __device__ __forceinline__ const unsigned char* wait(int piece) const {
    const int slot = i % kSlots;
    mbar_wait(full0 + (slot * kPieces + piece) * 8, (i / kSlots) & 1);
    return base + slot * kChunkBytes;
  }
  __device__ __forceinline__ unsigned char* wait_all() const {
    const int slot = i % kSlots;
    for (int p = 0; p < kPieces; ++p) mbar_wait(full0 + (slot * kPieces + p) * 8, (i / kSlots) & 1);
    return const_cast<unsigned char*>(base) + slot * kChunkBytes;
  }
  __device__ __forceinline__ void release() {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(empty0 + (i % kSlots) * 8);
    ++i;
  }
};

// The B fragments of the warp's 8 k-tiles of m16n8k16 (columns 128w .. 128w + 127 of x's 1,024), x
// (already bf16 values) the same in all 8 columns of B; held in registers for a phase's chunks.
struct Fragments {
  unsigned b[8][2];
  Fragments() = default;
  __device__ __forceinline__ explicit Fragments(const float* x) { load(x); }
  __device__ __forceinline__ void load(const float* x) {
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
};

// The 16 rows of NC chunks (a row spans them) against NC inputs' fragments, by tensor cores: each
// warp sums its columns in two chains of mma; the warps' sums meet in shared memory (ring.red, one
// buffer per call in turn, a consumer barrier), and thread p < 8 gets rows 2p and 2p + 1.
template <int NC>
__device__ __forceinline__ void rows_mma(Ring& ring, const Fragments* in, float (&acc)[2]) {
  float d[2][4] = {};
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    mma_chunk(d, ring.wait(threadIdx.x >> 6), in[c].b);  // the copy that holds the warp's fragments
    ring.release();
  }
  float (*red)[16] = ring.red[ring.buf];
  ring.buf ^= 1;
  meet_warp_sums(d, red, acc);
}

// Rows 16r .. 16r + 15 of a projection whose rows span NC chunks, against hand-off X (NC x 1,024
// words, polled into xs), each rounded and added to its row of ``residual``: handed on to XN (and,
// given ``out``, stored there).
template <int NC>
__device__ __forceinline__ void project_residual(Ring& ring, const unsigned* X, unsigned tag_in, float* xs,
                                                 const float* residual, unsigned* XN, unsigned tag_out, int r,
                                                 __nv_bfloat16* out, unsigned* faults) {
  poll_bf16<NC>(X, NC * kCols, tag_in, xs, kSpinLimit, 0, faults);
  consumers_sync();
  Fragments in[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) in[c].load(xs + c * kCols);
  float acc[2];
  rows_mma<NC>(ring, in, acc);
  if (threadIdx.x < 8)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = 16 * r + 2 * threadIdx.x + i;
      const float v = residual[row] + bf16r(acc[i]);
      hand_bf16(XN, row, v, tag_out);
      if (out != nullptr) out[row] = __float2bfloat16_rn(v);
    }
}

// A (KV head, split) task's view of the step.
struct Task {
  int head, split, start, end, chunks;  // cached rows [start, end), 64 a chunk
  bool holds_new;                       // the new token's row is among them
};

// Warp r < 3 of a task: vector r of sh.qkv (q head 0, q head 1, k) through its head norm (weight w
// at the lane's 4 values 4 lane ..) and RoPE (cos/sin at those values' positions), as
// qkv_rope_store rounds them, in place. Lane l's values have their rotation partners in lane l ^ 16.
__device__ __forceinline__ void norm_rope(float* x, const float4& w, const float (&cs)[4], const float (&sn)[4],
                                          float eps) {
  const int lane = threadIdx.x & 31;
  float4 v = *reinterpret_cast<const float4*>(x + 4 * lane);
  float s = v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
  const float inv = rsqrtf(s / kHeadDim + eps);
  float n[4] = {bf16r(w.x * bf16r(v.x * inv)), bf16r(w.y * bf16r(v.y * inv)), bf16r(w.z * bf16r(v.z * inv)),
                bf16r(w.w * bf16r(v.w * inv))};
  const float sign = lane < 16 ? -1.f : 1.f;  // rotate_half: [-x2, x1]
  float o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float partner = __shfl_xor_sync(0xffffffffu, n[i], 16);
    o[i] = bf16r(bf16r(n[i] * cs[i]) + sign * bf16r(partner * sn[i]));
  }
  *reinterpret_cast<float4*>(x + 4 * lane) = make_float4(o[0], o[1], o[2], o[3]);
}

// A chunk of a task's cached rows (64 from r0, ``valid`` of them below the end) folded into the two
// query heads' running softmax (sh.stats: max and sum; o_run: thread t's output of head t / 128, dim
// t % 128): each warp's 8 rows' scores (2 heads) reduced together by halving exchanges, β added
// (``beta_row``: that of row 8 warp + lane / 4, whose score the lane writes), then P·V by quarters of
// the rows. The new token's K/V (sh.qkv[256, 512)) are patched into the copy of its row.
__device__ __forceinline__ void attend_rows(Ring& ring, Shared& sh, int r0, int valid, long long new_row,
                                            float beta_row, const float4& q0, const float4& q1, float scale,
                                            float& o_run) {
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  __nv_bfloat16* K = reinterpret_cast<__nv_bfloat16*>(ring.wait_all());
  __nv_bfloat16* V = K + kKeys * kHeadDim;
  if (new_row >= r0 && new_row < r0 + valid) {  // the copy holds the row's old K/V
    const int j = static_cast<int>(new_row - r0);
    if (t < kHeadDim) K[j * kHeadDim + t] = __float2bfloat16_rn(sh.qkv[256 + t]);
    else V[j * kHeadDim + t - kHeadDim] = __float2bfloat16_rn(sh.qkv[384 + t - kHeadDim]);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // before the producer copies into the slot again
    consumers_sync();
  }
  // scores: the warp's 16 sums (8 rows x 2 heads), value 2 r + head
  float s[16];
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const uint2 raw = *reinterpret_cast<const uint2*>(K + (8 * warp + r) * kHeadDim + lane * 4);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    s[2 * r] = q0.x * a.x + q0.y * a.y + q0.z * b.x + q0.w * b.y;
    s[2 * r + 1] = q1.x * a.x + q1.y * a.y + q1.z * b.x + q1.w * b.y;
  }
  halving_sums16(s, lane);  // lane l: value l / 2's sum
  const int my_row = 8 * warp + (lane >> 2);
  if ((lane & 1) == 0) sh.scores[lane & 2 ? 1 : 0][my_row] = my_row < valid ? s[0] * scale + beta_row : -INFINITY;
  consumers_sync();
  if (warp < 2) {  // warp i: query head i's running softmax
    const float a = sh.scores[warp][lane], b = sh.scores[warp][lane + 32];
    float m = fmaxf(a, b);
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
    const float m_old = sh.stats[warp][0], m_new = fmaxf(m_old, m);
    const float base = m_new == -INFINITY ? 0.f : m_new;  // no row so far: every weight 0
    const float pa = expf(a - base), pb = expf(b - base);
    float l = pa + pb;
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) l += __shfl_xor_sync(0xffffffffu, l, x);
    sh.scores[warp][lane] = pa;
    sh.scores[warp][lane + 32] = pb;
    __syncwarp();
    if (lane == 0) {
      const float alpha = expf(m_old - base);
      sh.alpha[warp] = alpha;
      sh.stats[warp][0] = m_new;
      sh.stats[warp][1] = sh.stats[warp][1] * alpha + l;
    }
  }
  consumers_sync();
  // P·V: warp w takes dims 64 (w % 2) .. and rows 16 (w / 2) ..; a lane a pair of dims for both heads
  const int qr = warp >> 1, dim = 64 * (warp & 1) + 2 * lane;
  float o4[2][2] = {};
#pragma unroll
  for (int j = 16 * qr; j < 16 * qr + 16; ++j) {
    if (j >= valid) break;  // rows past the cache's end hold whatever the slot held
    const float2 vv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(V + j * kHeadDim + dim));
#pragma unroll
    for (int hd = 0; hd < 2; ++hd) {
      o4[hd][0] = fmaf(sh.scores[hd][j], vv.x, o4[hd][0]);
      o4[hd][1] = fmaf(sh.scores[hd][j], vv.y, o4[hd][1]);
    }
  }
  float* red = sh.xn;  // [quarter][head][dim]: free from A's end to D's norm
#pragma unroll
  for (int hd = 0; hd < 2; ++hd)
    *reinterpret_cast<float2*>(red + (qr * 2 + hd) * kHeadDim + dim) = make_float2(o4[hd][0], o4[hd][1]);
  ring.release();
  consumers_sync();
  const int head = t >> 7, d = t & 127;
  const float o = (red[head * 128 + d] + red[(2 + head) * 128 + d]) + (red[(4 + head) * 128 + d] + red[(6 + head) * 128 + d]);
  o_run = o_run * sh.alpha[head] + o;
}

// One (KV head, split) task: the head's q/k/v rows polled, q/k normalised and rotated; the new K/V
// stored (if the task holds its row) and the queries recorded (split 0); then flash-decode with β over
// the task's cached rows, a chunk at a time (attend_rows) -> the two query
// heads' unnormalised outputs, max and sum, handed on.
__device__ void attend_task(Ring& ring, Shared& sh, const Params& pr, const Task& tk, int layer, long long slot,
                            long long new_row, const float (&cs)[4], const float (&sn)[4], unsigned tag_in,
                            unsigned tag_out, unsigned* faults) {
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const __nv_bfloat16* norms = pr.norms + static_cast<long long>(layer) * kNormElems;
  float4 w = make_float4(0.f, 0.f, 0.f, 0.f);
  if (warp < 3) w = load_bf16x4(norms + 2 * kCols + (warp < 2 ? 0 : kHeadDim) + 4 * lane);
  const float* beta = pr.beta + slot * pr.b_slot + layer * pr.b_layer + tk.head * pr.b_head;
  // the β of the row whose score this lane writes in the step over chunk c (and c + 1 if a pair)
  const auto beta_of = [&](int c) {
    const int r = tk.start + kKeys * c + 8 * warp + (lane >> 2);
    return r < tk.end ? __ldg(beta + r) : 0.f;
  };
  float beta_next = tk.chunks > 0 ? beta_of(0) : 0.f;
  // the head's 2 q rows, then its k and v rows
  const unsigned* q = pr.ho.qkv + 256 * tk.head;
  const unsigned* k = pr.ho.qkv + 2048 + kHeadDim * tk.head;
  const unsigned* v = pr.ho.qkv + 3072 + kHeadDim * tk.head;
  const auto src = [=](int g) { return g < 64 ? q + 4 * g : g < 96 ? k + 4 * (g - 64) : v + 4 * (g - 96); };
  poll<Bf16Group, 1>(128, src, sh.qkv, tag_in, kSpinLimit, 0, faults);
  consumers_sync();
  if (warp < 3) norm_rope(sh.qkv + kHeadDim * warp, w, cs, sn, pr.eps);
  if (t < 2) sh.stats[t][0] = -INFINITY, sh.stats[t][1] = 0.f;
  consumers_sync();
  if (tk.holds_new) {
    __nv_bfloat16* k_row = pr.k_cache + slot * pr.k_slot + layer * pr.k_layer + tk.head * pr.k_head + new_row * kHeadDim;
    __nv_bfloat16* v_row = pr.v_cache + slot * pr.v_slot + layer * pr.v_layer + tk.head * pr.v_head + new_row * kHeadDim;
    if (t < kHeadDim) k_row[t] = __float2bfloat16_rn(sh.qkv[256 + t]);
    else v_row[t - kHeadDim] = __float2bfloat16_rn(sh.qkv[384 + t - kHeadDim]);
  }
  if (tk.split == 0 && pr.q_out != nullptr)
    pr.q_out[layer * pr.q_layer + tk.head * 2 * kHeadDim + t] = __float2bfloat16_rn(sh.qkv[t]);
  const float4 q0 = *reinterpret_cast<const float4*>(sh.qkv + lane * 4);
  const float4 q1 = *reinterpret_cast<const float4*>(sh.qkv + 128 + lane * 4);
  const long long patch_row = tk.holds_new ? new_row : -1;
  float o_run = 0.f;
  for (int c = 0; c < tk.chunks; ++c) {
    const int r0 = tk.start + kKeys * c;
    const float beta_row = beta_next;
    if (c + 1 < tk.chunks) beta_next = beta_of(c + 1);
    attend_rows(ring, sh, r0, min(tk.end - r0, kKeys), patch_row, beta_row, q0, q1, pr.scale, o_run);
  }
  const int head = t >> 7, d = t & 127;
  unsigned long long* dst = pr.ho.part + ((tk.head * kSplits + tk.split) * 2 + head) * kPart;
  hand_f32(dst, d, o_run, tag_out);
  if (d < 2) hand_f32(dst, 128 + d, sh.stats[head][d], tag_out);
}

// The cached rows of each (KV head, split) task: splits of ceil(n / 16) rows rounded up to whole
// chunks (the persistent launch's split), so that 1,024 rows are a chunk a task.
__device__ __forceinline__ Task task_of(int task, int n, long long new_row) {
  Task tk;
  tk.head = task / kSplits;
  tk.split = task % kSplits;
  const int per = (n + kSplits - 1) / kSplits;
  const int split = (per + kKeys - 1) / kKeys * kKeys;
  tk.start = min(tk.split * split, n);
  tk.end = min(tk.start + split, n);
  tk.chunks = (tk.end - tk.start + kKeys - 1) / kKeys;
  tk.holds_new = new_row >= tk.start && new_row < tk.end;
  return tk;
}

// The producer: one thread copies the block's chunks, in the order its consumers use them, into the
// ring, at most kAhead 8 KB copies in flight.
struct Producer {
  unsigned char* smem;
  unsigned full0, empty0;
  unsigned long long policy;
  int i;

  // Chunk i's four pieces: src[p], bytes[p] (0: nothing to copy, the piece lands at once).
  __device__ __forceinline__ void copy(const unsigned char* const (&src)[kPieces], const unsigned (&bytes)[kPieces]) {
    const int slot = i % kSlots;
    mbar_wait(empty0 + slot * 8, ((i / kSlots) & 1) ^ 1);
    for (int p = 0; p < kPieces; ++p) {
      wait_landed<kPieces>(full0, i * kPieces + p - kAhead, kSlots);
      const unsigned full = full0 + (slot * kPieces + p) * 8;
      if (bytes[p] == 0) {
        mbar_arrive(full);
        continue;
      }
      expect_bytes(full, bytes[p]);
      bulk_copy(smem + slot * kChunkBytes + p * (kChunkBytes / kPieces), src[p], bytes[p], full, policy);
    }
    ++i;
  }
  __device__ __forceinline__ void weights(const __nv_bfloat16* W, int layer, int id) {
    const unsigned char* chunk =
        reinterpret_cast<const unsigned char*>(W + (static_cast<long long>(layer) * kLayerChunks + id) * kChunkElems);
    const unsigned char* src[kPieces];
    unsigned bytes[kPieces];
    for (int p = 0; p < kPieces; ++p) src[p] = chunk + p * (kChunkBytes / kPieces), bytes[p] = kChunkBytes / kPieces;
    copy(src, bytes);
  }
  // 64 cached rows from r0 (those below ``end``): K's two halves, then V's.
  __device__ __forceinline__ void keys(const __nv_bfloat16* k, const __nv_bfloat16* v, int r0, int end) {
    const unsigned char* src[kPieces];
    unsigned bytes[kPieces];
    for (int p = 0; p < kPieces; ++p) {
      const int first = r0 + 32 * (p % 2);
      src[p] = reinterpret_cast<const unsigned char*>((p < 2 ? k : v) + static_cast<long long>(first) * kHeadDim);
      bytes[p] = static_cast<unsigned>(max(0, min(32, end - first))) * kHeadDim * 2;
    }
    copy(src, bytes);
  }
};

__global__ void __launch_bounds__(kConsumers + 32, 1) tagged_layers_kernel(const Params pr) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(16) Shared sh;
  const int b = blockIdx.x, P = gridDim.x;
  const unsigned full0 = smem_addr(smem + kSlots * kChunkBytes);
  const unsigned empty0 = full0 + kSlots * kPieces * 8;
  // the step: a padding row (slot < 0) reads and writes no cache row
  const long long slot_in = *pr.slot, new_row = slot_in >= 0 ? *pr.row : -1;
  const long long slot = slot_in >= 0 ? slot_in : 0;
  const int n = slot_in >= 0 ? static_cast<int>(*pr.len) : 0;
  const int task_id = P - 1 - b;
  const bool has_b = task_id < kTasks, has_m = b < kQHeads;
  const bool has_c = b < 128 && b % 2 == 0, has_e = b < 128 && b % 2 == 1;
  const Task tk = task_of(has_b ? task_id : 0, n, new_row);
  int d_ids[kTableWidth], n_d = 0;
  for (int k = 0; k < kTableWidth && pr.table[kTableWidth * b + k] >= 0; ++k) d_ids[n_d++] = pr.table[kTableWidth * b + k];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) {
      for (int p = 0; p < kPieces; ++p) mbar_init(full0 + (s * kPieces + p) * 8, 1);
      mbar_init(empty0 + s * 8, 8);  // one per consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers) {
    if (threadIdx.x != kConsumers) return;
    Producer prod{smem, full0, empty0, evict_first_policy(), 0};
    for (int layer = 0; layer < pr.layers; ++layer) {
      for (int a = b; a < kA; a += P) prod.weights(pr.W, layer, a);
      if (has_b) {
        const __nv_bfloat16* k = pr.k_cache + slot * pr.k_slot + layer * pr.k_layer + tk.head * pr.k_head;
        const __nv_bfloat16* v = pr.v_cache + slot * pr.v_slot + layer * pr.v_layer + tk.head * pr.v_head;
        for (int c = 0; c < tk.chunks; ++c) prod.keys(k, v, tk.start + kKeys * c, tk.end);
      }
      if (has_c) prod.weights(pr.W, layer, kC0 + b), prod.weights(pr.W, layer, kC0 + b + 1);
      for (int k = 0; k < n_d; ++k) prod.weights(pr.W, layer, kD0 + d_ids[k]);
      if (has_e)
        for (int k = 0; k < 3; ++k) prod.weights(pr.W, layer, kE0 + 3 * (b / 2) + k);
    }
    return;
  }
  const int t = threadIdx.x;
  const unsigned seq = *reinterpret_cast<volatile unsigned*>(pr.state);
  unsigned* faults = pr.state + 2;
  Ring ring{smem, full0, empty0, 0, sh.mma_red, 0};
  // the lane's cos/sin for norm_rope: values 4 lane .. of a head, at position pos (the same every layer)
  float cs[4] = {}, sn[4] = {};
  if (t < 96) {
    const long long pos = *pr.pos;
    for (int i = 0; i < 4; ++i) {
      const int e = (4 * (t & 31) + i) % (kHeadDim / 2);
      cs[i] = __bfloat162float(pr.cos[pos * (kHeadDim / 2) + e]);
      sn[i] = __bfloat162float(pr.sin[pos * (kHeadDim / 2) + e]);
    }
  }
  for (int layer = 0; layer < pr.layers; ++layer) {
    const auto tag = [&](int handoff) { return tag_of(seq, pr.layers, layer, handoff); };
    const __nv_bfloat16* norms = pr.norms + static_cast<long long>(layer) * kNormElems;
    // A: h through in_norm; q/k/v rows
    const float4 w_in = load_bf16x4(norms + 4 * t);
    if (layer == 0) *reinterpret_cast<float4*>(sh.h + 4 * t) = load_bf16x4(pr.h0 + 4 * t);
    else poll_bf16<1>(pr.ho.h, kCols, tag_of(seq, pr.layers, layer - 1, 5), sh.h, kSpinLimit, 0, faults);
    normalise(sh.h, sh.xn, sh.red, w_in, pr.eps);
    {
      const Fragments in(sh.xn);
      float acc[2];
      for (int a = b; a < kA; a += P) {
        rows_mma<1>(ring, &in, acc);
        if (t < 8)
#pragma unroll
          for (int r = 0; r < 2; ++r) hand_bf16(pr.ho.qkv, 16 * a + 2 * t + r, acc[r], tag(0));
      }
    }
    // B: attention over the task's rows
    if (has_b) attend_task(ring, sh, pr, tk, layer, slot, new_row, cs, sn, tag(0), tag(1), faults);
    // M: query head b's 16 partials merged
    if (has_m) {
      const int kv = b / 2, qh = b % 2;
      const unsigned long long* part = pr.ho.part;
      const auto src = [=](int g) { return part + ((kv * kSplits + g / (kPart / 2)) * 2 + qh) * kPart + 2 * (g % (kPart / 2)); };
      poll<F32Group, 5>(kSplits * kPart / 2, src, sh.part, tag(1), kSpinLimit, 0, faults);
      consumers_sync();
      if (t < kHeadDim) {
        float m = -INFINITY;
        for (int s = 0; s < kSplits; ++s) m = fmaxf(m, sh.part[s * kPart + 128]);
        float o = 0.f, l = 0.f;
        if (m != -INFINITY)
          for (int s = 0; s < kSplits; ++s) {
            const float w = expf(sh.part[s * kPart + 128] - m);  // an empty split's max is -inf: 0
            o = fmaf(w, sh.part[s * kPart + t], o);
            l = fmaf(w, sh.part[s * kPart + 129], l);
          }
        hand_bf16(pr.ho.att, kHeadDim * b + t, l > 0.f ? o / l : 0.f, tag(2));
      }
      consumers_sync();  // the partials are read before sh.att (the same buffer) is written
    }
    // C: 16 rows of the output projection, plus h
    if (has_c) project_residual<2>(ring, pr.ho.att, tag(2), sh.att, sh.h, pr.ho.hmid, tag(3), b / 2, nullptr, faults);
    // D: h_mid through post_norm; gate and up rows, silu(gate) * up
    const float4 w_post = load_bf16x4(norms + kCols + 4 * t);
    poll_bf16<1>(pr.ho.hmid, kCols, tag(3), sh.hmid, kSpinLimit, 0, faults);
    normalise(sh.hmid, sh.xn, sh.red, w_post, pr.eps);
    {
      const Fragments in(sh.xn);
      float acc[2];
      for (int k = 0; k < n_d; ++k) {  // a chunk: rows 2p and 2p + 1 are gate and up row 8j + p
        rows_mma<1>(ring, &in, acc);
        if (t < 8) {
          const float g = bf16r(acc[0]), silu = bf16r(g / (1.f + expf(-g)));
          hand_bf16(pr.ho.act, 8 * d_ids[k] + t, silu * bf16r(acc[1]), tag(4));
        }
      }
    }
    // E: 16 rows of the down projection, plus h_mid
    if (has_e)
      project_residual<3>(ring, pr.ho.act, tag(4), sh.act, sh.hmid, pr.ho.h, tag(5), b / 2,
                          layer == pr.layers - 1 ? pr.out : nullptr, faults);
  }
  // the last block out starts the next launch's tags
  consumers_sync();
  if (t == 0) {
    __threadfence();
    if (atomicAdd(pr.state + 1, 1u) == static_cast<unsigned>(P - 1)) {
      pr.state[1] = 0;
      pr.state[0] = seq + 1;
      __threadfence();
    }
  }
}

}  // namespace

int64_t layer_chunks() { return kLayerChunks; }
int64_t norm_elems() { return kNormElems; }

// See tagged.py's tagged_layers for the arguments; words: int32 [11,264] and part: int64 [128 x 2 x
// 130], zeroed once; state: int32 [3], zeroed once; table: int32 [programs, 5].
void launch(const torch::Tensor& W, const torch::Tensor& norms, const torch::Tensor& cos, const torch::Tensor& sin,
            torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& beta, const torch::Tensor& positions,
            const torch::Tensor& slots, const torch::Tensor& rows, const torch::Tensor& lens, const torch::Tensor& h0,
            torch::Tensor& out, const c10::optional<torch::Tensor>& q_out, const torch::Tensor& table,
            torch::Tensor& words, torch::Tensor& part, torch::Tensor& state, int64_t layers, double eps, double scale) {
  const auto bf16 = torch::kBFloat16;
  const c10::cuda::OptionalCUDAGuard guard(W.device());  // the weights' device, whichever is current
  TORCH_CHECK(W.is_cuda() && W.scalar_type() == bf16 && W.is_contiguous() &&
                  W.numel() == layers * kLayerChunks * kChunkElems,
              "W: contiguous bf16 [layers, ", kLayerChunks, ", 16, 1024]");
  TORCH_CHECK(norms.scalar_type() == bf16 && norms.is_contiguous() && norms.numel() == layers * kNormElems,
              "norms: contiguous bf16 [layers, ", kNormElems, "]");
  TORCH_CHECK(cos.scalar_type() == bf16 && sin.scalar_type() == bf16 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.size(-1) == kHeadDim / 2 && sin.size(-1) == kHeadDim / 2,
              "cos, sin: contiguous bf16 [positions, 64]");
  for (const torch::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == bf16 && c->dim() == 5 && c->size(1) == layers && c->size(2) == kKvHeads &&
                    c->size(4) == kHeadDim && c->stride(4) == 1 && c->stride(3) == kHeadDim,
                "k_cache, v_cache: bf16 [slots, layers, 8, capacity, 128], rows contiguous");
  TORCH_CHECK(beta.scalar_type() == torch::kFloat32 && beta.dim() == 4 && beta.stride(3) == 1,
              "beta: float32 [slots, layers, 8, capacity], rows contiguous");
  for (const torch::Tensor* x : {&positions, &slots, &rows, &lens})
    TORCH_CHECK(x->is_cuda() && x->scalar_type() == torch::kInt64 && x->numel() >= 1,
                "positions, slots, rows, lens: int64 [1] on CUDA");
  TORCH_CHECK(h0.scalar_type() == bf16 && h0.numel() == kCols && out.scalar_type() == bf16 && out.numel() == kCols,
              "h0, out: bf16 [1024]");
  TORCH_CHECK(!q_out.has_value() || (q_out->scalar_type() == bf16 && q_out->size(0) == layers &&
                                     q_out->size(-2) == kQHeads && q_out->size(-1) == kHeadDim &&
                                     q_out->stride(-1) == 1 && q_out->stride(-2) == kHeadDim),
              "q_out: bf16 [layers, ., 16, 128], heads contiguous");
  const int programs = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  TORCH_CHECK(programs >= 128 && programs <= 256, "tagged layers need 128 to 256 multiprocessors, not ", programs);
  TORCH_CHECK(table.is_cuda() && table.scalar_type() == torch::kInt32 && table.numel() == programs * kTableWidth,
              "table: int32 [multiprocessors, 5] on CUDA");
  TORCH_CHECK(words.scalar_type() == torch::kInt32 && words.numel() == 11264, "words: int32 [11264]");
  TORCH_CHECK(part.scalar_type() == torch::kInt64 && part.numel() == kTasks * 2 * kPart, "part: int64 [33280]");
  TORCH_CHECK(state.scalar_type() == torch::kInt32 && state.numel() == 3, "state: int32 [3]");
  auto* w = reinterpret_cast<unsigned*>(words.data_ptr<int>());
  Params pr{};
  pr.W = reinterpret_cast<const __nv_bfloat16*>(W.data_ptr<at::BFloat16>());
  pr.norms = reinterpret_cast<const __nv_bfloat16*>(norms.data_ptr<at::BFloat16>());
  pr.cos = reinterpret_cast<const __nv_bfloat16*>(cos.data_ptr<at::BFloat16>());
  pr.sin = reinterpret_cast<const __nv_bfloat16*>(sin.data_ptr<at::BFloat16>());
  pr.k_cache = reinterpret_cast<__nv_bfloat16*>(k_cache.data_ptr<at::BFloat16>());
  pr.v_cache = reinterpret_cast<__nv_bfloat16*>(v_cache.data_ptr<at::BFloat16>());
  pr.beta = beta.data_ptr<float>();
  pr.k_slot = k_cache.stride(0), pr.k_layer = k_cache.stride(1), pr.k_head = k_cache.stride(2);
  pr.v_slot = v_cache.stride(0), pr.v_layer = v_cache.stride(1), pr.v_head = v_cache.stride(2);
  pr.b_slot = beta.stride(0), pr.b_layer = beta.stride(1), pr.b_head = beta.stride(2);
  pr.pos = positions.data_ptr<int64_t>(), pr.slot = slots.data_ptr<int64_t>();
  pr.row = rows.data_ptr<int64_t>(), pr.len = lens.data_ptr<int64_t>();
  pr.h0 = reinterpret_cast<const __nv_bfloat16*>(h0.data_ptr<at::BFloat16>());
  pr.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr<at::BFloat16>());
  pr.q_out = q_out.has_value() ? reinterpret_cast<__nv_bfloat16*>(q_out->data_ptr<at::BFloat16>()) : nullptr;
  pr.q_layer = q_out.has_value() ? q_out->stride(0) : 0;
  pr.table = table.data_ptr<int>();
  auto* parts = reinterpret_cast<unsigned long long*>(part.data_ptr<int64_t>());
  pr.ho = Handoffs{w, parts, w + 4096, w + 6144, w + 7168, w + 10240};
  pr.state = reinterpret_cast<unsigned*>(state.data_ptr<int>());
  pr.layers = static_cast<int>(layers);
  pr.eps = static_cast<float>(eps);
  pr.scale = static_cast<float>(scale);
  const int bytes = kSlots * kChunkBytes + (kPieces + 1) * kSlots * 8;
  C10_CUDA_CHECK(cudaFuncSetAttribute(tagged_layers_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  tagged_layers_kernel<<<programs, kConsumers + 32, bytes, at::cuda::getCurrentCUDAStream()>>>(pr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("launch", &launch, "every decoder layer of a batch-1 decode step (Qwen3-0.6B's shape) in one launch");
  m.def("layer_chunks", &layer_chunks, "32 KB weight chunks a layer");
  m.def("norm_elems", &norm_elems, "norm weights a layer");
}
