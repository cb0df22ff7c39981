"""The environment kvxfer sets for libfabric before libfabric is first loaded.

libfabric 1.17 as packaged by Debian links its psm provider against libinfinipath, whose
load-time constructor installs a SIGSEGV handler that turns a crash into exit status 1 and
writes a ``*.btr`` backtrace into the current directory; and ``fi_getinfo`` initialises
every built-in provider it is allowed to. kvxfer therefore, unless the user set them:

* ``FI_PROVIDER`` = ``KVXFER_PROVIDERS`` (libfabric's include list, fabric(7)): only the
  providers kvxfer supports are loaded;
* ``IPATH_NO_BACKTRACE=1``: libinfinipath installs no handler and writes no file.

A user who sets either variable keeps their value (e.g. ``FI_PROVIDER=^psm2`` to load
more providers); ``KVXFER_LIBFABRIC_ENV=0`` makes kvxfer set nothing at all. This must run
before ``kvxfer._fabric`` is imported (the dynamic loader runs libinfinipath's constructor
when ``_fabric`` loads libfabric), so ``kvxfer/__init__.py`` calls it; if the host process
loaded libfabric before kvxfer, it is too late and only the user's environment counts.
"""

from __future__ import annotations

import os

__all__ = ["KVXFER_PROVIDERS", "apply", "user_provider"]

#: The providers (and utility providers) kvxfer knows how to drive.
KVXFER_PROVIDERS = "efa,verbs,ofi_rxm,tcp,shm,psm3,cxi"

_USER_FI_PROVIDER = os.environ.get("FI_PROVIDER")
_applied = False


def apply() -> None:
    """Set the variables above where the user did not; idempotent."""
    global _applied
    if _applied:
        return
    _applied = True
    if os.environ.get("KVXFER_LIBFABRIC_ENV", "1") == "0":
        return
    if _USER_FI_PROVIDER is None:
        os.environ["FI_PROVIDER"] = KVXFER_PROVIDERS
    os.environ.setdefault("IPATH_NO_BACKTRACE", "1")


def user_provider() -> str | None:
    """The FI_PROVIDER the user set (None if kvxfer set it): Engine's default provider."""
    return _USER_FI_PROVIDER or None
