// metal_shim.h: the Metal Shading Language, as far as MLX's `metal_kernel` sources
// need it, as host C++ (g++ or clang++), so tests/metal_host.py can compile the
// exact source MLX generates and run it on the CPU. It stands in for what MLX puts
// in front of that source on a Mac (<metal_stdlib>, `using namespace metal`, the
// float16_t and bfloat16_t typedefs).
//
// A launch runs one threadgroup at a time; each GPU thread is a fiber (ucontext)
// of one OS thread, run until it blocks at a barrier or a simd op, in ascending or
// descending order: deterministic, so comparing the two orders exposes a race.
//
// Part 1 uses the C++ standard library; part 2 turns Metal's address-space words
// (device, constant, threadgroup, thread) into macros, so it must come last.
#pragma once
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <ucontext.h>
#include <vector>

// ---- scalar and vector types --------------------------------------------------
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

#if defined(__clang__) && __clang_major__ < 15
// clang 14 has no _Float16 on x86: __fp16 stores half, its math is float's. Its
// conversions call compiler-rt, which libgcc lacks: here, rounding to nearest even.
typedef __fp16 half;
extern "C" __attribute__((weak)) uint16_t __gnu_f2h_ieee(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f), sign = x >> 16 & 0x8000;
  const uint32_t a = x & 0x7fffffff;
  if (a > 0x7f800000) return sign | 0x7e00;  // NaN
  if (a >= 0x477ff000) return sign | 0x7c00;  // 65520 and up: infinity
  if (a < 0x38800000)  // under 2^-14: a multiple of 2^-24 (the scaling is exact)
    return sign | (uint16_t)std::nearbyint(std::bit_cast<float>(a) * 16777216.0f);
  return sign | (a - 0x38000000 + 0xfff + (a >> 13 & 1)) >> 13;
}
extern "C" __attribute__((weak)) float __gnu_h2f_ieee(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = h >> 10 & 0x1f, m = h & 0x3ff;
  if (e == 0)  // m * 2^-24, exact
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(m / 16777216.0f));
  if (e == 31) return std::bit_cast<float>(sign | 0x7f800000 | m << 13);
  return std::bit_cast<float>(sign | (e + 112) << 23 | m << 13);
}
#else
typedef _Float16 half;  // conversions from float round to nearest even
#endif
typedef half float16_t;

// bfloat (MSL 3.1): float32's top 16 bits. To float implicitly; from float only
// explicitly (static_cast<T>, as the bodies write it): never looser than Metal.
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  template <typename U, typename = std::enable_if_t<std::is_convertible_v<U, float> &&
                                                    !std::is_same_v<U, bfloat>>>
  explicit bfloat(U v) {
    const float f = static_cast<float>(v);
    const uint32_t u = std::bit_cast<uint32_t>(f);  // round to nearest even
    bits = std::isnan(f) ? 0x7fc0 : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  operator float() const { return std::bit_cast<float>((uint32_t)bits << 16); }
};
typedef bfloat bfloat16_t;

// The thread attributes' types. Metal's vectors have arithmetic; MLX's
// attributes only need the components.
template <typename T>
struct metal_vec3 {
  T x, y, z;
};
typedef metal_vec3<uint> uint3;

// ---- the launch runtime -------------------------------------------------------
namespace metalhost {

constexpr uint SIMD_WIDTH = 32;  // Apple GPUs' threads per simdgroup
constexpr uint MAX_THREADS = 1024;  // per threadgroup, at most, on every Apple GPU
constexpr size_t STACK_BYTES = 128 * 1024;

// Every attribute MLX may add to a kernel's signature, for one thread.
struct Thread {
  uint3 thread_position_in_grid, thread_position_in_threadgroup,
      threadgroup_position_in_grid, threads_per_threadgroup, threads_per_grid,
      threadgroups_per_grid, dispatch_threads_per_threadgroup, grid_origin,
      grid_size;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup,
      simdgroup_index_in_threadgroup, simdgroups_per_threadgroup,
      dispatch_simdgroups_per_threadgroup, threads_per_simdgroup,
      thread_execution_width, thread_index_in_quadgroup,
      quadgroup_index_in_threadgroup, quadgroups_per_threadgroup,
      dispatch_quadgroups_per_threadgroup;
};

enum State { RUNNABLE, AT_BARRIER, AT_SIMD, DONE };

// A simd op's result for lane `lane`, from the values of the `active` lanes.
using Combine = uint32_t (*)(const uint32_t* values, uint32_t active, uint lane,
                             uint32_t arg);

struct Lane {
  ucontext_t context;
  char* stack = nullptr;
  Thread t;
  State state = DONE;
  long site = 0;  // the source line it waits at
  uint32_t value = 0;  // a simd op's operand, then its result
  uint32_t arg = 0;  // the op's lane or delta
  Combine combine = nullptr;
};

using Body = void (*)(void* const* buffers, const Thread& t);

struct Region {  // one threadgroup variable: poisoned before every group
  void* at;
  size_t bytes;
};

struct Launch {
  ucontext_t scheduler;
  std::vector<Lane>* lanes;
  int current = -1;
  Body body;
  void* const* buffers;
  char* why;
  int why_len;
  bool failed = false;
};

inline thread_local Launch* running = nullptr;

// The first failure of a launch is its verdict.
template <typename... A>
void fail(const char* format, A... args) {
  Launch* l = running;
  if (l && !l->failed) {
    l->failed = true;
    std::snprintf(l->why, l->why_len, format, args...);
  }
}

// The running lane gives the CPU back: to wait (AT_BARRIER, AT_SIMD), or for
// good after a failure (it is never resumed: its frames hold nothing to free).
inline void yield(State state, long site) {
  Launch& l = *running;
  Lane& me = (*l.lanes)[l.current];
  me.state = state;
  me.site = site;
  swapcontext(&me.context, &l.scheduler);
}

inline void lane_main() {
  Launch& l = *running;
  Lane& me = (*l.lanes)[l.current];
  l.body(l.buffers, me.t);
  me.state = DONE;  // returns to uc_link, the scheduler
}

inline std::vector<char*>& stacks() {  // reused by every launch
  static std::vector<char*> pool;
  return pool;
}

// Releases one simdgroup's lanes that wait at the same simd op; false if none.
inline bool release_simd(std::vector<Lane>& lanes, const std::vector<int>& order) {
  for (int i : order) {
    if (lanes[i].state != AT_SIMD) continue;
    const uint group = lanes[i].t.simdgroup_index_in_threadgroup;
    const long site = lanes[i].site;
    uint32_t values[SIMD_WIDTH], active = 0;
    std::vector<int> members;
    for (int j : order) {
      Lane& o = lanes[j];
      if (o.state == AT_SIMD && o.site == site &&
          o.t.simdgroup_index_in_threadgroup == group) {
        values[o.t.thread_index_in_simdgroup] = o.value;
        active |= 1u << o.t.thread_index_in_simdgroup;
        members.push_back(j);
      }
    }
    // Lanes elsewhere (returned, or in another branch) are inactive, as on a GPU.
    for (int j : members) {
      Lane& o = lanes[j];
      o.value = o.combine(values, active, o.t.thread_index_in_simdgroup, o.arg);
      o.state = RUNNABLE;
    }
    return true;
  }
  return false;
}

// Runs one threadgroup's lanes in `order` until all return; false on a failure
// (a barrier not every thread reaches, a lane that failed).
inline bool run_group(Launch& l, const std::vector<int>& order, const uint3& group) {
  std::vector<Lane>& lanes = *l.lanes;
  for (;;) {
    for (int i : order) {
      if (lanes[i].state != RUNNABLE) continue;
      l.current = i;
      swapcontext(&l.scheduler, &lanes[i].context);
      if (l.failed) return false;
    }
    int done = 0, waiting = 0;
    long site = -1, other = -1;
    for (int i : order) {
      if (lanes[i].state == DONE) ++done;
      if (lanes[i].state != AT_BARRIER) continue;
      ++waiting;
      if (site < 0) site = lanes[i].site;
      if (lanes[i].site != site) other = lanes[i].site;
    }
    if (done == (int)order.size()) return true;
    if (release_simd(lanes, order)) continue;
    if (other >= 0) {
      fail("threadgroup (%u, %u, %u): its threads wait at different "
           "threadgroup_barrier calls (lines %ld and %ld)",
           group.x, group.y, group.z, site, other);
      return false;
    }
    if (done > 0) {
      fail("threadgroup (%u, %u, %u): %d of its threads wait at the "
           "threadgroup_barrier on line %ld of its source, %d returned without it: "
           "a barrier not every thread reaches",
           group.x, group.y, group.z, waiting, site, done);
      return false;
    }
    for (int i : order) lanes[i].state = RUNNABLE;
  }
}

// Runs `body` over the grid as Metal's dispatchThreads does and as MLX calls it:
// `grid` counts threads, a threadgroup is min(threadgroup, grid) per axis, and the
// last group of an axis is partial (its threads past the grid do not exist).
// Groups and the threads of each in ascending order, or both in descending
// order (`descending`); each group's threadgroup variables (`regions`) poisoned
// (0xff bytes: NaN, -1) first. 0, or 1 with the reason in `why`.
inline int launch(const uint* grid_in, const uint* group_in, int descending,
                  const Region* regions, int n_regions, Body body,
                  void* const* buffers, char* why, int why_len) {
  uint g[3], t[3], n[3];
  for (int a = 0; a < 3; ++a) {
    g[a] = grid_in[a];
    t[a] = std::min(group_in[a], g[a]);
    n[a] = t[a] ? (g[a] + t[a] - 1) / t[a] : 0;
  }
  const uint per_group = t[0] * t[1] * t[2];
  Launch l;
  l.body = body;
  l.buffers = buffers;
  l.why = why;
  l.why_len = why_len;
  Launch* outer = running;
  running = &l;
  if (per_group == 0 || per_group > MAX_THREADS) {
    fail("threadgroup of %u threads: Metal runs 1 to %u", per_group, MAX_THREADS);
    running = outer;
    return 1;
  }
  std::vector<char*>& pool = stacks();
  while (pool.size() < per_group) pool.push_back(new char[STACK_BYTES]);
  std::vector<Lane> lanes(per_group);
  l.lanes = &lanes;
  const uint groups = n[0] * n[1] * n[2];
  for (uint k = 0; k < groups && !l.failed; ++k) {
    const uint gi = descending ? groups - 1 - k : k;
    const uint3 gp = {gi % n[0], gi / n[0] % n[1], gi / (n[0] * n[1])};
    const uint3 size = {std::min(t[0], g[0] - gp.x * t[0]),
                        std::min(t[1], g[1] - gp.y * t[1]),
                        std::min(t[2], g[2] - gp.z * t[2])};
    const uint count = size.x * size.y * size.z;
    std::vector<int> order;
    for (uint i = 0; i < count; ++i) {  // thread i of this (maybe partial) group
      const uint3 p = {i % size.x, i / size.x % size.y, i / (size.x * size.y)};
      Lane& lane = lanes[i];
      Thread& th = lane.t;
      th.thread_position_in_threadgroup = p;
      th.threadgroup_position_in_grid = gp;
      th.thread_position_in_grid = {gp.x * t[0] + p.x, gp.y * t[1] + p.y,
                                    gp.z * t[2] + p.z};
      th.threads_per_threadgroup = size;
      th.dispatch_threads_per_threadgroup = {t[0], t[1], t[2]};
      th.threads_per_grid = th.grid_size = {g[0], g[1], g[2]};
      th.grid_origin = {0, 0, 0};
      th.threadgroups_per_grid = {n[0], n[1], n[2]};
      th.thread_index_in_threadgroup = i;
      th.threads_per_simdgroup = th.thread_execution_width = SIMD_WIDTH;
      th.thread_index_in_simdgroup = i % SIMD_WIDTH;
      th.simdgroup_index_in_threadgroup = i / SIMD_WIDTH;
      th.simdgroups_per_threadgroup = (count + SIMD_WIDTH - 1) / SIMD_WIDTH;
      th.dispatch_simdgroups_per_threadgroup = (per_group + SIMD_WIDTH - 1) / SIMD_WIDTH;
      th.thread_index_in_quadgroup = i % 4;
      th.quadgroup_index_in_threadgroup = i / 4;
      th.quadgroups_per_threadgroup = (count + 3) / 4;
      th.dispatch_quadgroups_per_threadgroup = (per_group + 3) / 4;
      lane.state = RUNNABLE;
      lane.stack = pool[i];
      getcontext(&lane.context);
      lane.context.uc_stack.ss_sp = lane.stack;
      lane.context.uc_stack.ss_size = STACK_BYTES;
      lane.context.uc_link = &l.scheduler;
      makecontext(&lane.context, lane_main, 0);
      order.push_back((int)i);
    }
    if (descending) std::reverse(order.begin(), order.end());
    for (int r = 0; r < n_regions; ++r)
      std::memset(regions[r].at, 0xff, regions[r].bytes);
    run_group(l, order, gp);
  }
  running = outer;
  return l.failed ? 1 : 0;
}

// A simd op: the lane publishes `value` and waits for its simdgroup.
inline uint32_t exchange(uint32_t value, Combine combine, uint32_t arg, long site) {
  Launch& l = *running;
  Lane& me = (*l.lanes)[l.current];
  me.value = value;
  me.combine = combine;
  me.arg = arg;
  yield(AT_SIMD, site);
  return (*l.lanes)[l.current].value;
}

template <typename T>
uint32_t to_bits(T v) {
  static_assert(sizeof(T) <= 4, "simd ops on 32-bit values at most");
  uint32_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

template <typename T>
T from_bits(uint32_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

// The active lanes in lane order (a GPU's order is its own).
template <typename T, typename Op>
uint32_t reduce(const uint32_t* values, uint32_t active, Op op) {
  bool first = true;
  T acc{};
  for (uint i = 0; i < SIMD_WIDTH; ++i) {
    if (!(active >> i & 1)) continue;
    const T x = from_bits<T>(values[i]);
    acc = first ? x : op(acc, x);
    first = false;
  }
  return to_bits(acc);
}

// Lane `src`'s value, or poison where that lane is not active (undefined on Metal).
inline uint32_t pick(const uint32_t* values, uint32_t active, uint src) {
  return src < SIMD_WIDTH && (active >> src & 1) ? values[src] : 0xffffffffu;
}

// What the bounds sanitizer reports (-fsanitize=bounds, gcc's and clang's ABI):
// an index past a fixed-size array, e.g. a threadgroup array too short.
struct SourceLocation {
  const char* file;
  uint32_t line, column;
};
struct OutOfBounds {
  SourceLocation where;
};

}  // namespace metalhost

// The sanitizer calls this before the bad access: the launch fails and the lane
// stops there, so nothing is written out of bounds. Weak: one per object file.
extern "C" __attribute__((weak)) void __ubsan_handle_out_of_bounds(
    metalhost::OutOfBounds* data, void* index) {
  metalhost::fail("index %ld out of bounds of a fixed-size array (%s:%u)",
                  (long)(intptr_t)index, data->where.file, data->where.line);
  if (metalhost::running && metalhost::running->current >= 0)
    metalhost::yield(metalhost::DONE, 0);
}

// ---- the Metal Shading Language's names ---------------------------------------
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2,
                              mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags((uint)a | (uint)b);
}

// A barrier is known by its line: every thread of the group must wait at the
// same one (__builtin_LINE: the caller's line, in gcc and clang).
inline void threadgroup_barrier(mem_flags, long line = __builtin_LINE()) {
  metalhost::yield(metalhost::AT_BARRIER, line);
}

template <typename To, typename From>
To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type: the types' sizes differ");
  return std::bit_cast<To>(v);
}

namespace metal {
// MLX's kernels run with math_mode "safe": precise and fast both map to libm
// here (more accurate than Metal's; see docs/kernels.md).
#define METALSHIM_MATH(ns)                                                \
  namespace ns {                                                          \
  inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }             \
  inline float sqrt(float x) { return std::sqrt(x); }                     \
  inline float exp(float x) { return std::exp(x); }                       \
  inline float exp2(float x) { return std::exp2(x); }                     \
  inline float log(float x) { return std::log(x); }                       \
  inline float log2(float x) { return std::log2(x); }                     \
  inline float cos(float x) { return std::cos(x); }                       \
  inline float sin(float x) { return std::sin(x); }                       \
  inline float tan(float x) { return std::tan(x); }                       \
  inline float tanh(float x) { return std::tanh(x); }                     \
  inline float pow(float x, float y) { return std::pow(x, y); }           \
  inline float divide(float x, float y) { return x / y; }                 \
  }
METALSHIM_MATH(precise)
METALSHIM_MATH(fast)
#undef METALSHIM_MATH
using precise::cos;
using precise::exp;
using precise::exp2;
using precise::log;
using precise::log2;
using precise::pow;
using precise::rsqrt;
using precise::sin;
using precise::sqrt;
using precise::tan;
using precise::tanh;
inline float abs(float x) { return std::fabs(x); }  // int: the C library's
inline float fabs(float x) { return std::fabs(x); }
inline float floor(float x) { return std::floor(x); }
inline float ceil(float x) { return std::ceil(x); }
inline float round(float x) { return std::round(x); }
inline float trunc(float x) { return std::trunc(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
template <typename T>
T max(T a, T b) { return a > b ? a : b; }
template <typename T>
T min(T a, T b) { return a < b ? a : b; }
template <typename T>
T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }

// simd ops: the lanes of a simdgroup meet, as at a barrier of their own.
#define METALSHIM_SITE long site = __builtin_LINE()
#define METALSHIM_REDUCE(name, expr)                                          \
  template <typename T>                                                       \
  T name(T v, METALSHIM_SITE) {                                               \
    return metalhost::from_bits<T>(metalhost::exchange(                       \
        metalhost::to_bits(v),                                                \
        [](const uint32_t* vs, uint32_t active, uint, uint32_t) {             \
          return metalhost::reduce<T>(vs, active,                             \
                                      [](T a, T x) { return T(expr); });      \
        },                                                                    \
        0, site));                                                            \
  }
METALSHIM_REDUCE(simd_sum, a + x)
METALSHIM_REDUCE(simd_product, a * x)
METALSHIM_REDUCE(simd_max, x > a ? x : a)
METALSHIM_REDUCE(simd_min, x < a ? x : a)
#undef METALSHIM_REDUCE
#define METALSHIM_SHUFFLE(name, source)                                       \
  template <typename T>                                                       \
  T name(T v, ushort n, METALSHIM_SITE) {                                     \
    return metalhost::from_bits<T>(metalhost::exchange(                       \
        metalhost::to_bits(v),                                                \
        [](const uint32_t* vs, uint32_t active, uint i, uint32_t n) {         \
          return metalhost::pick(vs, active, source);                         \
        },                                                                    \
        n, site));                                                            \
  }
METALSHIM_SHUFFLE(simd_shuffle, n)
METALSHIM_SHUFFLE(simd_broadcast, n)
METALSHIM_SHUFFLE(simd_shuffle_xor, i ^ n)
// Lanes whose source is past the simdgroup keep their own value.
METALSHIM_SHUFFLE(simd_shuffle_down, i + n < metalhost::SIMD_WIDTH ? i + n : i)
METALSHIM_SHUFFLE(simd_shuffle_up, i >= n ? i - n : i)
#undef METALSHIM_SHUFFLE
#undef METALSHIM_SITE
inline void simdgroup_barrier(mem_flags, long site = __builtin_LINE()) {
  metalhost::exchange(0, [](const uint32_t*, uint32_t, uint, uint32_t) { return 0u; },
                      0, site);
}
}  // namespace metal
using namespace metal;

// ---- address spaces (after every C++ header) ----------------------------------
// Device and constant buffers are plain memory. A threadgroup variable is one
// static per kernel instantiation, shared by the threads of the group running now
// (groups run one at a time); metal_host.py finds each one in the library's
// symbols and has it poisoned before every group.
#define device
#define constant
#define threadgroup static
#define thread
// What Metal lacks fails to compile here too.
#define double metal_has_no_double
#define std metal_has_no_std_namespace
