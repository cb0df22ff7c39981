"""Build kvxfer._fabric in place with whatever setuptools and Cython this Python has.

For a machine that cannot make the venv (the GPU device machine reaches no network): older
setuptools refuse this project's pyproject.toml (its SPDX ``license`` string), which only
describes the package, so this build reads setup.py's extension and nothing else.

    python3 bench/build_inplace.py
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    os.chdir(ROOT)
    sys.path.insert(0, ROOT)
    import setuptools
    import setuptools.dist

    # metadata only: the extension comes from setup.py
    setuptools.dist.Distribution.parse_config_files = lambda self, *a, **k: None
    import setup as kx_setup

    setuptools.setup(name="kvxfer", ext_modules=kx_setup.extensions(), cmdclass={"build_ext": kx_setup.BuildExt},
                     script_args=["build_ext", "--inplace", "-q"])


if __name__ == "__main__":
    main()
