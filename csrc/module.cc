// pybind11 module kernjax._ffi: hands XLA FFI handler symbols to Python.
//
// registrations() returns {"cpu": {name: capsule}, "cuda": {name: capsule}};
// kernjax/kernels/ffi.py registers each capsule with jax.ffi.register_ffi_target. The
// "cuda" dict is empty unless the extension was built with nvcc (setup.py then
// defines KERNJAX_CUDA). KERNJAX_JAX_VERSION is the jax version the extension
// was built against; the FFI ABI is only promised for that version.
//
// host_alloc/host_free give out zeroed host memory for slots that ops write
// (mark's `slot`): plain aligned memory, or with mapped=True pinned memory
// mapped into every device (what the CUDA handlers need). Nothing here touches
// a GPU at import; CUDA is first used when something asks for it.

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <string>

#ifdef KERNJAX_CUDA
#include <cuda_runtime_api.h>
#endif

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "edge.h"
#include "kj.h"

#include "xla/ffi/api/ffi.h"

namespace py = pybind11;

#ifndef KERNJAX_JAX_VERSION
#define KERNJAX_JAX_VERSION "unknown"
#endif

XLA_FFI_DECLARE_HANDLER_SYMBOL(KjMarkCpu);          // mark.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjMxfp4ShuffleCpu);  // mxfp4_shuffle.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjKdaCpu);           // kda.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjHoldCpu);          // edge.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjRecvCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjPushCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjPostCpu);
#ifdef KERNJAX_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjMarkCuda);          // mark.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjMxfp4ShuffleCuda);  // mxfp4_shuffle.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjKdaCuda);           // kda.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjHoldCuda);          // edge.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjRecvCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjPushCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjPostCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjFa3Cuda);           // fa3.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjFa3CudaGraph);
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjQkRopeCuda);        // dense.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjHeadNormCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjRopeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjKvWriteCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(KjAddNormCuda);
namespace kj {
std::string Fa3Load(const std::string& path);
bool Fa3Loaded();
}  // namespace kj
#endif

namespace {

template <typename T>
py::capsule Encapsulate(T* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

// Zeroed host memory, 64-byte aligned; pinned and mapped into every device's
// address space when `mapped` (needs the CUDA build and a GPU).
uintptr_t HostAlloc(size_t nbytes, bool mapped) {
  size_t size = (nbytes + 63) / 64 * 64;
  if (size == 0) size = 64;
  void* ptr = nullptr;
  if (mapped) {
#ifdef KERNJAX_CUDA
    cudaError_t err = cudaHostAlloc(
        &ptr, size, cudaHostAllocMapped | cudaHostAllocPortable);
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("cudaHostAlloc: ") +
                               cudaGetErrorName(err) + ": " +
                               cudaGetErrorString(err));
    }
#else
    throw std::runtime_error(
        "mapped host memory needs kernjax._ffi built with CUDA (nvcc)");
#endif
  } else {
    ptr = std::aligned_alloc(64, size);
    if (ptr == nullptr) throw std::bad_alloc();
  }
  std::memset(ptr, 0, size);
  return reinterpret_cast<uintptr_t>(ptr);
}

// Waits, the GIL released, until the int32 at `addr` (host memory a program writes: kj_mark's
// slot) is at least `want` or `timeout` s passed: spins 2 ms, then looks every ~20 us. Returns
// the last value seen.
int32_t WaitWord(uintptr_t addr, int32_t want, double timeout) {
  py::gil_scoped_release nogil;
  const auto* w = reinterpret_cast<const int32_t*>(addr);
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const int32_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (v >= want || t > timeout) return v;
    if (t > 0.002) {
      timespec pause{0, 20000};
      nanosleep(&pause, nullptr);
    }
  }
}

void HostFree(uintptr_t addr, bool mapped) {
  void* ptr = reinterpret_cast<void*>(addr);
  if (ptr == nullptr) return;
  if (mapped) {
#ifdef KERNJAX_CUDA
    cudaError_t err = cudaFreeHost(ptr);
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("cudaFreeHost: ") +
                               cudaGetErrorName(err));
    }
#else
    throw std::runtime_error("mapped host memory needs the CUDA build");
#endif
  } else {
    std::free(ptr);
  }
}

// Pins host memory someone else allocated (an edge's shared memory) and maps it into the devices,
// so CUDA handlers can read and write it; HostUnregister undoes it.
void HostRegister(uintptr_t addr, size_t nbytes) {
#ifdef KERNJAX_CUDA
  cudaError_t err = cudaHostRegister(reinterpret_cast<void*>(addr), nbytes,
                                     cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("cudaHostRegister: ") + cudaGetErrorName(err));
#else
  (void)addr, (void)nbytes;
  throw std::runtime_error("registering host memory needs kernjax._ffi built with CUDA");
#endif
}

void HostUnregister(uintptr_t addr) {
#ifdef KERNJAX_CUDA
  cudaHostUnregister(reinterpret_cast<void*>(addr));
#else
  (void)addr;
#endif
}

// Device memory for an edge's slots, allocated outside JAX (whose buffers cannot be exported over
// CUDA IPC) on the current device, zeroed: (address, IPC handle bytes). The stage before opens
// the handle with IpcOpen and writes into it over NVLink; DeviceFree/IpcClose give it back.
#ifdef KERNJAX_CUDA
void CudaCheck(const char* what, cudaError_t err) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
}
#endif

py::tuple DeviceAlloc(size_t nbytes) {
#ifdef KERNJAX_CUDA
  void* ptr = nullptr;
  CudaCheck("cudaMalloc", cudaMalloc(&ptr, nbytes));
  CudaCheck("cudaMemset", cudaMemset(ptr, 0, nbytes));
  cudaIpcMemHandle_t h;
  CudaCheck("cudaIpcGetMemHandle", cudaIpcGetMemHandle(&h, ptr));
  return py::make_tuple(reinterpret_cast<uintptr_t>(ptr),
                        py::bytes(reinterpret_cast<const char*>(&h), sizeof(h)));
#else
  (void)nbytes;
  throw std::runtime_error("device slots need kernjax._ffi built with CUDA");
#endif
}

uintptr_t IpcOpen(const std::string& handle) {
#ifdef KERNJAX_CUDA
  cudaIpcMemHandle_t h;
  if (handle.size() != sizeof(h)) throw std::invalid_argument("not a CUDA IPC handle");
  std::memcpy(&h, handle.data(), sizeof(h));
  void* ptr = nullptr;
  CudaCheck("cudaIpcOpenMemHandle",
            cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<uintptr_t>(ptr);
#else
  (void)handle;
  throw std::runtime_error("CUDA IPC needs kernjax._ffi built with CUDA");
#endif
}

void DeviceFree(uintptr_t addr, bool opened) {
#ifdef KERNJAX_CUDA
  void* ptr = reinterpret_cast<void*>(addr);
  if (opened) cudaIpcCloseMemHandle(ptr); else cudaFree(ptr);
#else
  (void)addr, (void)opened;
#endif
}

constexpr bool kHasCuda =
#ifdef KERNJAX_CUDA
    true;
#else
    false;
#endif

}  // namespace

PYBIND11_MODULE(_ffi, m) {
  m.doc() = "kernjax XLA FFI handlers (see kernjax/kernels/ffi.py)";

  m.def(
      "registrations",
      []() {
        py::dict cpu;
        cpu["kj_mark"] = Encapsulate(KjMarkCpu);
        cpu["kj_mxfp4_shuffle"] = Encapsulate(KjMxfp4ShuffleCpu);
        cpu["kj_kda"] = Encapsulate(KjKdaCpu);
        cpu["kj_hold"] = Encapsulate(KjHoldCpu);
        cpu["kj_recv"] = Encapsulate(KjRecvCpu);
        cpu["kj_push"] = Encapsulate(KjPushCpu);
        cpu["kj_post"] = Encapsulate(KjPostCpu);
        py::dict cuda;
#ifdef KERNJAX_CUDA
        cuda["kj_mark"] = Encapsulate(KjMarkCuda);
        cuda["kj_mxfp4_shuffle"] = Encapsulate(KjMxfp4ShuffleCuda);
        cuda["kj_kda"] = Encapsulate(KjKdaCuda);
        cuda["kj_hold"] = Encapsulate(KjHoldCuda);
        cuda["kj_recv"] = Encapsulate(KjRecvCuda);
        cuda["kj_push"] = Encapsulate(KjPushCuda);
        cuda["kj_post"] = Encapsulate(KjPostCuda);
        // the same code twice: one XLA may capture into its CUDA graphs, one it keeps outside
        // them (the lowering table's fa3_graphs picks the target a program calls)
        cuda["kj_fa3"] = Encapsulate(KjFa3CudaGraph);
        cuda["kj_fa3_ungraphed"] = Encapsulate(KjFa3Cuda);
        cuda["kj_qk_rope"] = Encapsulate(KjQkRopeCuda);
        cuda["kj_head_norm"] = Encapsulate(KjHeadNormCuda);
        cuda["kj_rope"] = Encapsulate(KjRopeCuda);
        cuda["kj_kv_write"] = Encapsulate(KjKvWriteCuda);
        cuda["kj_add_norm"] = Encapsulate(KjAddNormCuda);
#endif
        py::dict out;
        out["cpu"] = cpu;
        out["cuda"] = cuda;
        return out;
      },
      "{'cpu': {name: capsule}, 'cuda': {name: capsule}} of FFI handlers.");

  m.def(
      "has_cuda", []() { return kHasCuda; },
      "True if the CUDA handlers were compiled in.");

  m.def("host_alloc", &HostAlloc, py::arg("nbytes"), py::arg("mapped") = false,
        "Address of `nbytes` of zeroed, 64-byte aligned host memory; pinned "
        "and mapped into the devices when mapped=True. Free with host_free.");
  m.def("wait_word", &WaitWord, py::arg("addr"), py::arg("want"), py::arg("timeout"),
        "Waits (GIL released) until the int32 at addr is >= want or timeout s pass; its value.");
  m.def("bind_slot", [](uint64_t i, uint64_t a) { if (i > 0 && i < 64) kj_slots[i] = a; }, py::arg("id"),
        py::arg("addr"), "Binds kj_mark's slot `id` (1..63) of this process to address `addr`.");
  m.def("host_free", &HostFree, py::arg("addr"), py::arg("mapped") = false,
        "Frees memory from host_alloc, with the same `mapped`.");

  m.def("bind_edge", &kj::BindEdge, py::arg("edge"), py::arg("arrived"), py::arg("taken"),
        py::arg("base"), py::arg("stride"), py::arg("nslots"), py::arg("offsets"),
        py::arg("sizes"),
        "Binds edge `edge` of this process to its memory (csrc/edge.h): the addresses of its "
        "arrived and taken int32 words and of slot 0, the bytes between slots, the number of "
        "slots, and each departure's offset and size within a slot.");
  m.def("host_register", &HostRegister, py::arg("addr"), py::arg("nbytes"),
        "Pins and maps host memory allocated elsewhere (cudaHostRegister, mapped).");
  m.def("host_unregister", &HostUnregister, py::arg("addr"), "Undoes host_register.");
  m.def("device_alloc", &DeviceAlloc, py::arg("nbytes"),
        "(address, CUDA IPC handle bytes) of zeroed device memory on the current device.");
  m.def("ipc_open", &IpcOpen, py::arg("handle"), "Maps another process's device_alloc memory.");
  m.def("device_free", &DeviceFree, py::arg("addr"), py::arg("opened") = false,
        "Frees device_alloc memory, or (opened=True) unmaps ipc_open memory.");
  m.def("nccl_load", &kj::NcclLoad, py::arg("path"), "Loads NCCL (libnccl.so.2) from `path`.");
#ifdef KERNJAX_CUDA
  m.def("fa3_load", &kj::Fa3Load, py::arg("path"),
        "Loads FlashAttention-3 for kj_fa3 (libkj_fa3.so, scripts/fa3) from `path`; returns "
        "'' or what went wrong.");
  m.def("fa3_loaded", &kj::Fa3Loaded, "True once fa3_load has succeeded.");
#endif
  m.def("nccl_unique_id", []() { return py::bytes(kj::NcclUniqueId()); },
        "A new NCCL unique id (128 bytes) for one edge's communicator.");
  m.def("nccl_bind_edge", &kj::NcclBindEdge, py::arg("edge"), py::arg("arrived"),
        py::arg("taken"), py::arg("uid"), py::arg("rank"), py::arg("sizes"),
        py::call_guard<py::gil_scoped_release>(),
        "Binds `edge` to a two-rank NCCL communicator (upstream rank 0, downstream 1); blocks "
        "until both stages have joined. The words are this process's own.");
  m.def("unbind_edge", &kj::UnbindEdge, py::arg("edge"), "Forgets edge `edge`'s binding.");
  m.def("set_hold_timeout", &kj::SetHoldTimeout, py::arg("seconds"),
        "Seconds a hold waits before it fails (CPU) or traps (CUDA); 60 by default.");

  m.def(
      "jax_version", []() { return std::string(KERNJAX_JAX_VERSION); },
      "The jax version this extension was built against.");
}
