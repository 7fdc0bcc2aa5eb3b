// The edges between stages, as the edge ops (edge.cc, edge.cu) see them.
//
// An edge joins stage s (upstream) to stage s+1 (downstream). Its memory is a ring of `nslots`
// slots, each holding one item's departures at fixed offsets, and two int32 words:
//   arrived  items whose departures are in their slot (the upstream posts k+1 after pushing
//            item k; the downstream holds until it reads k+1);
//   taken    items the downstream has read out of their slot (it posts k+1 after reading item
//            k; the upstream holds until taken >= k-nslots+1 before it pushes item k).
// Where both stages map the same memory (shared memory between processes of one host, CUDA
// IPC) the words and slots are the same bytes on both sides and no host thread relays anything;
// otherwise a host transport copies them across.
//
// Programs name an edge by its number (stage s's outgoing edge is s) and a departure by its
// index: the addresses are bound per process (kernjax._ffi.bind_edge), so an exported stage
// program runs in any process that binds its edges. Per-step values (the item's sequence number,
// a hold's target) are operands.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace kj {

struct Edge {
  bool bound = false;
  uint64_t arrived = 0;  // address of the int32 word
  uint64_t taken = 0;
  uint64_t base = 0;     // slot 0's address
  int64_t stride = 0;    // bytes from one slot to the next
  int32_t nslots = 0;
  std::vector<int64_t> offsets, sizes;  // each departure's place in a slot
  void* comm = nullptr;  // NCCL: the departures go by ncclSend/ncclRecv to `peer`, no slots;
  int peer = -1;         // the words are this process's own (post marks an item done)
  // CUDA: the device's view of arrived, taken and slot 0, looked up once (0: not yet)
  mutable uint64_t dev[3] = {0, 0, 0};
};

constexpr int kMaxEdges = 64;

// The process's edges (edge.cc). A handler reads its edge's binding when it runs.
Edge* FindEdge(int64_t edge, std::string* error);
// Seconds a hold waits before it fails (the CPU) or traps (a GPU); 60 unless set.
double HoldTimeout();

// Bindings, from Python (module.cc): addresses of this process's view of the edge's memory.
void BindEdge(int64_t edge, uint64_t arrived, uint64_t taken, uint64_t base, int64_t stride,
              int32_t nslots, std::vector<int64_t> offsets, std::vector<int64_t> sizes);
// Validates `e` and makes it edge `edge`'s binding, whole (BindEdge's and NcclBindEdge's end).
void Install(int64_t edge, Edge e);
void UnbindEdge(int64_t edge);
// NCCL (nccl.cc, CUDA builds): the library loaded from `path`, a unique id, and an edge bound to a
// two-rank communicator (this process `rank`, the other 1 - rank); blocks until both have joined.
void NcclLoad(const std::string& path);
std::string NcclUniqueId();
void NcclBindEdge(int64_t edge, uint64_t arrived, uint64_t taken, const std::string& uid, int rank,
                  std::vector<int64_t> sizes);
// Enqueue a send or receive of `bytes` on `stream` (a cudaStream_t); empty string on success.
std::string NcclMove(const Edge& e, bool send, void* buf, uint64_t bytes, void* stream);
void SetHoldTimeout(double seconds);

// The word of `edge` a hold waits on or a post writes: 0 arrived, 1 taken.
inline uint64_t Word(const Edge& e, int64_t which) { return which == 0 ? e.arrived : e.taken; }

// What a hold for item `item` waits for the word to reach: its arrivals (word 0, arrived >= item
// + 1), or the item nslots before it taken out of the slot it will use (word 1).
inline int32_t Want(const Edge& e, int64_t which, int32_t item) {
  return which == 0 ? item + 1 : item + 1 - e.nslots;
}

// Where departure `index` of item `seq` lives; empty error on success.
inline std::string Place(const Edge& e, int64_t index, int32_t seq, uint64_t bytes,
                         uint64_t* addr) {
  if (index < 0 || index >= static_cast<int64_t>(e.offsets.size()))
    return "departure index " + std::to_string(index) + " is not one of the edge's " +
           std::to_string(e.offsets.size());
  if (static_cast<int64_t>(bytes) != e.sizes[index])
    return "departure " + std::to_string(index) + " is " + std::to_string(bytes) +
           " bytes; the edge's slot holds " + std::to_string(e.sizes[index]);
  if (seq < 0) return "negative sequence number " + std::to_string(seq);
  *addr = e.base + static_cast<uint64_t>(seq % e.nslots) * e.stride + e.offsets[index];
  return "";
}

// Each edge op's operands, attributes and results, one list for its CPU and its CUDA handler
// (one exported program binds to either): `b` is xla::ffi::Ffi::Bind(), on CUDA with the stream.
//   hold(tok, target, *after) [edge, word] -> tok      recv(tok, seq) [edge, index] -> x, tok
//   push(x, tok, seq) [edge, index] -> tok             post(tok, value) [edge, word] -> tok
// `after` orders the hold behind other values; `seq`/`target`/`value` are per-item operands.
template <typename B>
auto BindHold(B b) {
  using S32 = xla::ffi::Buffer<xla::ffi::S32>;
  return std::move(b).template Arg<S32>().template Arg<S32>().RemainingArgs()
      .template Attr<int64_t>("edge").template Attr<int64_t>("word").template Ret<S32>();
}
template <typename B>
auto BindRecv(B b) {
  using S32 = xla::ffi::Buffer<xla::ffi::S32>;
  return std::move(b).template Arg<S32>().template Arg<S32>().template Attr<int64_t>("edge")
      .template Attr<int64_t>("index").template Ret<xla::ffi::AnyBuffer>().template Ret<S32>();
}
template <typename B>
auto BindPush(B b) {
  using S32 = xla::ffi::Buffer<xla::ffi::S32>;
  return std::move(b).template Arg<xla::ffi::AnyBuffer>().template Arg<S32>().template Arg<S32>()
      .template Attr<int64_t>("edge").template Attr<int64_t>("index").template Ret<S32>();
}
template <typename B>
auto BindPost(B b) {
  using S32 = xla::ffi::Buffer<xla::ffi::S32>;
  return std::move(b).template Arg<S32>().template Arg<S32>().template Attr<int64_t>("edge")
      .template Attr<int64_t>("word").template Ret<S32>();
}

}  // namespace kj
