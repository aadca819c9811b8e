"""Build the tensorshare Python package: `pip install ./python` (add --no-build-isolation, or
use a virtual environment made with --system-site-packages on Debian, whose pip refuses to
write to the system's site-packages without --break-system-packages).

The extension links libtensorshare. It is found, in this order:
- TS_BUILD_DIR=DIR in the environment: an in-tree build (cmake -B DIR); the headers come from
  this checkout's include/, the library from DIR/lib, and the extension gets DIR/lib as its run
  path;
- pkg-config tensorshare (an installed libtensorshare, any prefix: PKG_CONFIG_PATH);
- the compiler's default paths (/usr, /usr/local).
Only Debian's python3-dev and python3-setuptools are needed; nothing is downloaded.
"""
import glob
import os
import shlex
import subprocess

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def pkg_config(*args):
    try:
        out = subprocess.run(["pkg-config"] + list(args) + ["tensorshare"], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return shlex.split(out)


def library_flags():
    include_dirs, library_dirs, rpath = [os.path.join(HERE, "src")], [], []
    build = os.environ.get("TS_BUILD_DIR")
    if build:
        build = os.path.abspath(build)
        include_dirs.append(os.path.join(HERE, "..", "include"))
        library_dirs.append(os.path.join(build, "lib"))
        rpath.append(os.path.join(build, "lib"))
        return include_dirs, library_dirs, rpath
    cflags = pkg_config("--cflags")
    libs = pkg_config("--libs")
    if cflags is not None and libs is not None:
        include_dirs += [f[2:] for f in cflags if f.startswith("-I")]
        library_dirs += [f[2:] for f in libs if f.startswith("-L")]
        libdir = pkg_config("--variable=libdir")
        if libdir and libdir[0] not in ("/usr/lib", "/usr/local/lib"):
            rpath.append(libdir[0])
    elif os.path.exists(os.path.join(HERE, "..", "include", "tensorshare", "tensorshare.h")):
        include_dirs.append(os.path.join(HERE, "..", "include"))
    return include_dirs, library_dirs, rpath


include_dirs, library_dirs, rpath = library_flags()
sources = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "src", "*.c")))

setup(
    name="tensorshare",
    version="0.7.2",
    description="Share tensors between programs through the tensord daemon",
    license="MIT",
    packages=["tensorshare"],
    package_data={"tensorshare": ["*.pyi", "py.typed"]},
    ext_modules=[
        Extension(
            "tensorshare._tensorshare",
            sources=sources,
            include_dirs=include_dirs,
            library_dirs=library_dirs,
            runtime_library_dirs=rpath,
            libraries=["tensorshare"],
            extra_compile_args=["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-D_DEFAULT_SOURCE"],
        )
    ],
    python_requires=">=3.9",
    zip_safe=False,
)
