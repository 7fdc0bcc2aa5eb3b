"""Build kernjax: its Python packages and the XLA FFI extension kernjax._ffi.

Packages: kernjax with its subpackages (kernjax.serve and the like, when
present) and kernjax.models, whose sources live in the top-level models/.

kernjax._ffi is csrc/*.cc compiled as C++17 (g++, or $CXX) against pybind11
and the XLA FFI headers that ship with jaxlib (jax.ffi.include_dir()). When
nvcc is found ($CUDA_HOME/bin/nvcc, else nvcc on PATH) and KERNJAX_NO_CUDA is
not set, csrc/*.cu are also compiled with nvcc and linked into the same
extension with a static cudart (so importing it needs no GPU or CUDA install),
and KERNJAX_CUDA=1 tells csrc/module.cc to register the CUDA handlers.
KERNJAX_CUDA_ARCH overrides the GPU targets: compute capabilities separated by
commas, default "90"; SASS for each, plus PTX for the last. The nvcc objects
stay in build/nvcc/ between builds (pip builds each in a new temporary
directory), and one is compiled again only when its source, a csrc/*.h, its
command line, nvcc's version or jax's changed; `build_ext --force` compiles all.

    pip install --no-build-isolation -e .    # or without -e
"""

import concurrent.futures
import glob
import os
import re
import shutil
import subprocess

import jax
import jax.ffi
import pybind11
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


def find_nvcc():
    """nvcc's path, or None if there is none or KERNJAX_NO_CUDA is set."""
    if os.environ.get("KERNJAX_NO_CUDA"):
        return None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.isfile(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc")


def cuda_dirs(nvcc):
    """(include dir, dir holding libcudart_static.a) of this nvcc's CUDA root."""
    roots = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    # nvcc may be a wrapper script; its dry run names the real CUDA root.
    dry = subprocess.run(
        [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
        capture_output=True, text=True)
    top = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.M)
    if top:
        roots.insert(0, os.path.realpath(top.group(1).strip()))
    for root in roots:
        for inc, lib in (("include", "lib64"), ("include", "lib"),
                         ("targets/x86_64-linux/include", "targets/x86_64-linux/lib")):
            if (os.path.isfile(os.path.join(root, inc, "cuda_runtime_api.h"))
                    and os.path.isfile(os.path.join(root, lib, "libcudart_static.a"))):
                return os.path.join(root, inc), os.path.join(root, lib)
    raise RuntimeError(f"no CUDA headers and libcudart_static.a under {roots}")


def gencode_flags():
    archs = [a.replace(".", "").removeprefix("sm_").removeprefix("compute_")
             for a in re.split(r"[,;\s]+", os.environ.get("KERNJAX_CUDA_ARCH", "90"))
             if a]
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return flags + ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]


# The nvcc objects, kept between builds: pip builds an editable install in a new temporary
# directory each time, and the CUDA files are most of the build's time.
NVCC_OBJS = os.path.join("build", "nvcc")


def up_to_date(obj, key, deps):
    """Whether `obj` was compiled by the command `key` names and is newer than each of `deps`."""
    try:
        with open(obj + ".cmd") as f:
            return f.read() == key and os.path.getmtime(obj) >= max(map(os.path.getmtime, deps))
    except OSError:
        return False


class BuildExt(build_ext):
    """build_ext that adds the nvcc-compiled csrc/*.cu objects when it can; an object whose
    source, csrc headers, nvcc command, nvcc and jax are unchanged is not compiled again."""

    def build_extension(self, ext):
        nvcc = find_nvcc()
        cu_sources = sorted(glob.glob("csrc/*.cu"))
        if nvcc and cu_sources:
            os.makedirs(NVCC_OBJS, exist_ok=True)
            objs = [os.path.join(NVCC_OBJS, os.path.basename(s) + ".o") for s in cu_sources]
            cmds = [[nvcc, "-c", src, "-o", obj, "-O2", "-std=c++17",
                     "-Xcompiler", "-fPIC,-fvisibility=hidden",
                     *gencode_flags(), *(f"-I{d}" for d in ext.include_dirs)]
                    for src, obj in zip(cu_sources, objs)]
            version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
            keys = ["\n".join([*cmd, f"jax {jax.__version__}", version]) for cmd in cmds]
            headers = glob.glob("csrc/*.h")
            todo = [(cmd, obj, key) for cmd, obj, key, src in zip(cmds, objs, keys, cu_sources)
                    if self.force or not up_to_date(obj, key, [src, *headers])]

            def compile_one(job):
                cmd, obj, key = job
                if os.path.exists(obj + ".cmd"):
                    os.remove(obj + ".cmd")
                self.spawn(cmd)
                with open(obj + ".cmd", "w") as f:
                    f.write(key)

            print(f"nvcc: {len(todo)} of {len(cmds)} CUDA objects to compile, the rest in "
                  f"{NVCC_OBJS} are up to date")
            if todo:  # one nvcc per source at once
                workers = min(len(todo), os.cpu_count() or 1)
                with concurrent.futures.ThreadPoolExecutor(workers) as ex:
                    list(ex.map(compile_one, todo))
            ext.extra_objects += objs
            include_dir, lib_dir = cuda_dirs(nvcc)
            ext.define_macros.append(("KERNJAX_CUDA", "1"))
            ext.include_dirs.append(include_dir)
            ext.library_dirs.append(lib_dir)
            ext.libraries += ["cudart_static", "dl", "rt", "pthread"]
            # Keep the static cudart's symbols private to this extension.
            ext.extra_link_args.append("-Wl,--exclude-libs,libcudart_static.a")
        super().build_extension(ext)


packages = ["kernjax", *find_packages(include=["kernjax.*"])]
package_dir = {}
if os.path.isdir("models"):
    packages += ["kernjax.models",
                 *("kernjax.models." + p for p in find_packages("models"))]
    package_dir["kernjax.models"] = "models"

ffi_ext = Extension(
    "kernjax._ffi",
    sources=sorted(glob.glob("csrc/*.cc")),
    depends=sorted(glob.glob("csrc/*.cu") + glob.glob("csrc/*.h")),
    include_dirs=[pybind11.get_include(), jax.ffi.include_dir()],
    define_macros=[("KERNJAX_JAX_VERSION", f'"{jax.__version__}"')],
    extra_compile_args=["-O2", "-std=c++17", "-fvisibility=hidden"],
    language="c++",
)

setup(
    packages=packages,
    package_dir=package_dir,
    ext_modules=[ffi_ext],
    cmdclass={"build_ext": BuildExt},
)
