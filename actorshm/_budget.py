"""How much shared memory a process may own by default, and its fd limit."""

from __future__ import annotations

import os


def default_budget() -> int:
    """``ACTORSHM_SHM_BUDGET`` bytes, else half the machine's RAM."""
    env = os.environ.get("ACTORSHM_SHM_BUDGET")
    if env:
        return int(float(env))
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover
        total = 16 << 30
    return total // 2


def fd_limit() -> int:
    """This process's soft limit on open file descriptors."""
    import resource
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
