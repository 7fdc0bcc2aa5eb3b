// The edge ops on the CPU, and the process's edge bindings (edge.h).
//
//   kj_hold(tok, item, *after) edge, word  waits until item `item`'s slot is ready (word 0: its
//                                        arrivals are in; word 1: the item `nslots` before it
//                                        was taken); `after` only orders it; tok passes on
//   kj_recv(tok, seq) edge, index        -> (departure `index` of item seq, read from its slot, tok)
//   kj_push(x, tok, seq) edge, index     writes x into item seq's slot; tok passes on
//   kj_post(tok, value) edge, word       stores value into the word (a release store)
//
// tok is an int32[1] threaded through the ops of one edge, so data dependence orders them (XLA
// orders side-effecting calls by nothing else). A hold spins, then sleeps between looks, and fails
// with a message after HoldTimeout() seconds: a stage whose neighbour died ends, never hangs.

#include "edge.h"

#include <time.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace kj {
namespace {
Edge g_edges[kMaxEdges];
std::mutex g_mu;
double g_timeout = 60.0;
}  // namespace

Edge* FindEdge(int64_t edge, std::string* error) {
  if (edge < 0 || edge >= kMaxEdges) {
    *error = "edge " + std::to_string(edge) + " is out of range";
    return nullptr;
  }
  Edge* e = &g_edges[edge];
  if (!e->bound) {
    *error = "edge " + std::to_string(edge) +
             " is not bound in this process (kernjax.runtime.edge binds a stage's edges before it runs)";
    return nullptr;
  }
  return e;
}

double HoldTimeout() { return g_timeout; }

void BindEdge(int64_t edge, uint64_t arrived, uint64_t taken, uint64_t base, int64_t stride,
              int32_t nslots, std::vector<int64_t> offsets, std::vector<int64_t> sizes) {
  Install(edge, Edge{true, arrived, taken, base, stride, nslots, std::move(offsets),
                     std::move(sizes)});
}

void Install(int64_t edge, Edge e) {
  if (edge < 0 || edge >= kMaxEdges) throw std::invalid_argument("edge out of range");
  if (e.nslots < 1 || e.offsets.size() != e.sizes.size() || e.arrived % 4 || e.taken % 4)
    throw std::invalid_argument("bad edge binding");
  for (size_t i = 0; i < e.offsets.size(); ++i)
    if (e.offsets[i] < 0 || e.sizes[i] < 0 || e.offsets[i] + e.sizes[i] > e.stride)
      throw std::invalid_argument("a departure does not fit its slot");
  std::lock_guard<std::mutex> lock(g_mu);
  g_edges[edge] = std::move(e);
}

void UnbindEdge(int64_t edge) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (edge >= 0 && edge < kMaxEdges) g_edges[edge] = Edge{};
}

void SetHoldTimeout(double seconds) { g_timeout = seconds; }

}  // namespace kj

namespace {

ffi::Error Bad(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

void PassOn(ffi::Buffer<ffi::S32> tok, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  if (out->typed_data() != tok.typed_data()) out->typed_data()[0] = tok.typed_data()[0];
}

ffi::Error HoldImpl(ffi::Buffer<ffi::S32> tok, ffi::Buffer<ffi::S32> target,
                    ffi::RemainingArgs, int64_t edge, int64_t word,
                    ffi::Result<ffi::Buffer<ffi::S32>> out) {
  std::string err;
  kj::Edge* e = kj::FindEdge(edge, &err);
  if (!e) return Bad("kj_hold", err);
  if (e->comm) return Bad("kj_hold", "an NCCL edge runs on GPUs only");
  auto* w = reinterpret_cast<int32_t*>(kj::Word(*e, word));
  const int32_t want = kj::Want(*e, word, target.typed_data()[0]);
  const auto start = std::chrono::steady_clock::now();
  long pause_ns = 2000;  // a few spins, then sleeps from 2 us doubling to 100 us between looks:
  // a waiting stage must not take the cores its neighbour computes on
  for (int64_t spins = 0; __atomic_load_n(w, __ATOMIC_ACQUIRE) < want; ++spins) {
    if (spins < 64) continue;
    timespec pause{0, pause_ns};
    nanosleep(&pause, nullptr);
    pause_ns = pause_ns < 100000 ? pause_ns * 2 : 100000;
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > kj::HoldTimeout()) {
      return ffi::Error::Internal(
          "kj_hold: edge " + std::to_string(edge) + "'s " + (word == 0 ? "arrived" : "taken") +
          " word stayed at " + std::to_string(__atomic_load_n(w, __ATOMIC_ACQUIRE)) + " for " +
          std::to_string(static_cast<int>(waited)) + " s; this item needs " +
          std::to_string(want) + ": the " + (word == 0 ? "stage before" : "stage after") +
          " stopped");
    }
  }
  PassOn(tok, out);
  return ffi::Error::Success();
}

ffi::Error RecvImpl(ffi::Buffer<ffi::S32> tok, ffi::Buffer<ffi::S32> seq, int64_t edge,
                    int64_t index, ffi::Result<ffi::AnyBuffer> x,
                    ffi::Result<ffi::Buffer<ffi::S32>> out) {
  std::string err;
  kj::Edge* e = kj::FindEdge(edge, &err);
  if (!e) return Bad("kj_recv", err);
  if (e->comm) return Bad("kj_recv", "an NCCL edge runs on GPUs only");
  uint64_t addr = 0;
  err = kj::Place(*e, index, seq.typed_data()[0], x->size_bytes(), &addr);
  if (!err.empty()) return Bad("kj_recv", "edge " + std::to_string(edge) + ": " + err);
  std::memcpy(x->untyped_data(), reinterpret_cast<const void*>(addr), x->size_bytes());
  PassOn(tok, out);
  return ffi::Error::Success();
}

ffi::Error PushImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> tok, ffi::Buffer<ffi::S32> seq,
                    int64_t edge, int64_t index, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  std::string err;
  kj::Edge* e = kj::FindEdge(edge, &err);
  if (!e) return Bad("kj_push", err);
  if (e->comm) return Bad("kj_push", "an NCCL edge runs on GPUs only");
  uint64_t addr = 0;
  err = kj::Place(*e, index, seq.typed_data()[0], x.size_bytes(), &addr);
  if (!err.empty()) return Bad("kj_push", "edge " + std::to_string(edge) + ": " + err);
  std::memcpy(reinterpret_cast<void*>(addr), x.untyped_data(), x.size_bytes());
  PassOn(tok, out);
  return ffi::Error::Success();
}

ffi::Error PostImpl(ffi::Buffer<ffi::S32> tok, ffi::Buffer<ffi::S32> value, int64_t edge,
                    int64_t word, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  std::string err;
  kj::Edge* e = kj::FindEdge(edge, &err);
  if (!e) return Bad("kj_post", err);
  __atomic_store_n(reinterpret_cast<int32_t*>(kj::Word(*e, word)), value.typed_data()[0],
                   __ATOMIC_RELEASE);
  PassOn(tok, out);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KjHoldCpu, HoldImpl, kj::BindHold(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(KjRecvCpu, RecvImpl, kj::BindRecv(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(KjPushCpu, PushImpl, kj::BindPush(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(KjPostCpu, PostImpl, kj::BindPost(ffi::Ffi::Bind()));
