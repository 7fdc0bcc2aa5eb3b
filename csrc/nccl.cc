// NCCL for the edges between stages on different hosts (edge.h): the library is loaded at run
// time (dlopen; on the device image it is the nvidia-nccl wheel's), so the extension builds and
// imports without it. An edge bound here is a two-rank communicator: the upstream stage is rank 0,
// the downstream rank 1, and each item's departures go by ncclSend/ncclRecv on XLA's stream, in
// departure order on both sides (edge.cu). Only the declarations used are written out below;
// their values are NCCL's (nccl.h: ncclUint8 = 1, ncclSuccess = 0).

#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <stdexcept>

#include "edge.h"

namespace kj {
namespace {

struct UniqueId { char internal[128]; };
using Comm = void*;
using GetUniqueIdFn = int (*)(UniqueId*);
using InitRankFn = int (*)(Comm*, int, UniqueId, int);
using MoveFn = int (*)(void*, size_t, int, int, Comm, void*);  // send's buffer is const
using ErrorFn = const char* (*)(int);

struct Nccl {
  void* lib = nullptr;
  GetUniqueIdFn get_unique_id = nullptr;
  InitRankFn init_rank = nullptr;
  MoveFn send = nullptr, recv = nullptr;
  ErrorFn error = nullptr;
} g_nccl;
std::mutex g_nccl_mu;

constexpr int kUint8 = 1;

void Need() {
  if (!g_nccl.lib) throw std::runtime_error("NCCL is not loaded (kernjax.runtime.edge loads it)");
}

void Check(const char* what, int r) {
  if (r != 0)
    throw std::runtime_error(std::string(what) + ": " +
                             (g_nccl.error ? g_nccl.error(r) : std::to_string(r)));
}

}  // namespace

void NcclLoad(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_nccl_mu);
  if (g_nccl.lib) return;
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) throw std::runtime_error("cannot load NCCL from " + path + ": " + dlerror());
  auto sym = [&](const char* name) {
    void* f = dlsym(lib, name);
    if (!f) throw std::runtime_error(std::string("NCCL has no ") + name);
    return f;
  };
  g_nccl.get_unique_id = reinterpret_cast<GetUniqueIdFn>(sym("ncclGetUniqueId"));
  g_nccl.init_rank = reinterpret_cast<InitRankFn>(sym("ncclCommInitRank"));
  g_nccl.send = reinterpret_cast<MoveFn>(sym("ncclSend"));
  g_nccl.recv = reinterpret_cast<MoveFn>(sym("ncclRecv"));
  g_nccl.error = reinterpret_cast<ErrorFn>(sym("ncclGetErrorString"));
  g_nccl.lib = lib;
}

std::string NcclUniqueId() {
  Need();
  UniqueId id;
  Check("ncclGetUniqueId", g_nccl.get_unique_id(&id));
  return std::string(id.internal, sizeof(id.internal));
}

void NcclBindEdge(int64_t edge, uint64_t arrived, uint64_t taken, const std::string& uid, int rank,
                  std::vector<int64_t> sizes) {
  Need();
  if (uid.size() != sizeof(UniqueId)) throw std::invalid_argument("not an NCCL unique id");
  if (rank != 0 && rank != 1) throw std::invalid_argument("an edge has ranks 0 and 1");
  UniqueId id;
  std::memcpy(id.internal, uid.data(), sizeof(id.internal));
  Comm comm = nullptr;
  Check("ncclCommInitRank", g_nccl.init_rank(&comm, 2, id, rank));
  std::vector<int64_t> offsets(sizes.size(), 0);
  int64_t widest = 0;
  for (int64_t b : sizes) widest = b > widest ? b : widest;
  // comm and peer go in with the rest: no op ever sees this edge without its communicator
  Install(edge, Edge{true, arrived, taken, 0, widest, 1, std::move(offsets), std::move(sizes),
                     comm, 1 - rank});
}

std::string NcclMove(const Edge& e, bool send, void* buf, uint64_t bytes, void* stream) {
  if (!g_nccl.lib || !e.comm) return "the edge has no NCCL communicator";
  int r = (send ? g_nccl.send : g_nccl.recv)(buf, bytes, kUint8, e.peer, e.comm, stream);
  return r == 0 ? "" : std::string(send ? "ncclSend: " : "ncclRecv: ") + g_nccl.error(r);
}

}  // namespace kj
