"""Build kvxfer._fabric against the system libfabric found with pkg-config (1.17 ... 2.x).

The native engine (src/*.c, public header include/kvxfer/kvxfer.h) is compiled with its own
strict flags (-Wall -Wextra) and linked into the Cython extension; Cython's generated C
includes only the public header."""

import glob
import os
import shlex
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE_SOURCES = sorted(glob.glob(os.path.join("src", "*.c")))
NATIVE_CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-fvisibility=hidden"]


def pkg_config(*args: str) -> list[str]:
    try:
        out = subprocess.run(["pkg-config", *args, "libfabric"], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(
            "kvxfer needs libfabric's development files: `apt-get install libfabric-dev` "
            f"(pkg-config libfabric failed: {exc})"
        ) from None
    return shlex.split(out)


class BuildExt(build_ext):
    """Compile the native engine's translation units first, then link them into the extension."""

    def build_extension(self, ext):
        objects = self.compiler.compile(
            NATIVE_SOURCES,
            output_dir=self.build_temp,
            include_dirs=ext.include_dirs,
            extra_postargs=NATIVE_CFLAGS + ext.extra_compile_args,
            depends=ext.depends,
        )
        ext.extra_objects = list(objects) + list(ext.extra_objects or [])
        super().build_extension(ext)


def extensions():
    from Cython.Build import cythonize

    cflags = pkg_config("--cflags")
    libs = pkg_config("--libs")
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"] \
        if os.environ.get("KVXFER_SANITIZE") else []   # make sanitize
    ext = Extension(
        "kvxfer._fabric",
        sources=["kvxfer/_fabric.pyx"],
        include_dirs=["include"] + [f[2:] for f in cflags if f.startswith("-I")],
        library_dirs=[f[2:] for f in libs if f.startswith("-L")],
        libraries=[f[2:] for f in libs if f.startswith("-l")] + ["crypto"],   # src/announce.c: HMAC-SHA256
        extra_compile_args=["-O1" if san else "-O2", "-g", "-std=gnu11"] + san
        + [f for f in cflags if not f.startswith("-I")],
        extra_link_args=san,
        depends=NATIVE_SOURCES + glob.glob(os.path.join("src", "*.h")) + glob.glob(os.path.join("include", "kvxfer", "*.h")),
    )
    return cythonize([ext], language_level=3, compiler_directives={"embedsignature": True})


if __name__ == "__main__":      # pip's build backend runs it so too; bench/build_inplace.py imports it
    setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
