"""Build kvxfer._fabric against the system libfabric found with pkg-config (1.17 ... 2.x)."""

import os
import shlex
import subprocess

from setuptools import Extension, setup


def pkg_config(*args: str) -> list[str]:
    try:
        out = subprocess.run(["pkg-config", *args, "libfabric"], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(
            "kvxfer needs libfabric's development files: `apt-get install libfabric-dev` "
            f"(pkg-config libfabric failed: {exc})"
        ) from None
    return shlex.split(out)


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
        libraries=[f[2:] for f in libs if f.startswith("-l")],
        extra_compile_args=["-O1" if san else "-O2", "-g", "-std=gnu11", "-Wno-unused-function"] + san
        + [f for f in cflags if not f.startswith("-I")],
        extra_link_args=san,
        depends=[os.path.join("include", "kvxfer", h) for h in os.listdir(os.path.join("include", "kvxfer"))],
    )
    return cythonize([ext], language_level=3, compiler_directives={"embedsignature": True})


setup(ext_modules=extensions())
