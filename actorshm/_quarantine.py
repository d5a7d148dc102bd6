"""Quarantine: blocks kept from going home because a process downstream may still use them.

A process whose peer dies holding blocks it passed on (forward notices, see ``_leases``)
keeps those blocks here rather than recycling them. In the driver, which knows every
process that could hold one (``set_census``: the actors it started), they are kept only
until no such process lives; elsewhere, for as long as the process runs.
"""

from __future__ import annotations

# Blocks kept from going home: a process downstream may still use them, and nothing will
# tell us when it stops (a peer that passed them on ended, or we closed a connection to a
# peer that lives on; see ``Connection.close``).
_quarantine: list = []
# Driver only: (blocks, pids of the processes that could still hold them).
_quarantine_holders: list = []
_census = None  # ``set_census``


def quarantined() -> int:
    """How many blocks are kept from going home (``quarantine``)."""
    return len(_quarantine)


def quarantine(blocks: list) -> None:
    """Keep these blocks from going home: a peer they were passed to may still use them
    through a process that passed them on, and nothing will tell us when it stops.

    Where this process knows every process that could hold them (the driver: the actors
    it started, ``set_census``), they are kept only until each of those, and each started
    while one of them lived (it could have been passed a block), has exited."""
    _quarantine.extend(blocks)
    if _census is not None and blocks:
        _quarantine_holders.append((list(blocks), set(_census())))


def until() -> str:
    """How long this process keeps quarantined blocks, in words (for its warning)."""
    if _census is not None:
        return ("until every process that could hold them has exited (at the latest "
                "when the runtime closes)")
    return "for as long as it runs"


def set_census(census) -> None:
    """``census()`` returns the pids of every live process that could hold our blocks."""
    global _census
    _census = census


def process_started(pid: int) -> None:
    """A process started: it could be handed a quarantined block by a live holder."""
    for _, holders in _quarantine_holders:
        if holders:
            holders.add(pid)


def process_gone(pid: int) -> None:
    """Process ``pid`` exited: blocks no live process can hold any more go home."""
    done = False
    for blocks, holders in _quarantine_holders:
        holders.discard(pid)
        if not holders:
            done = True
            ids = {id(b) for b in blocks}
            _quarantine[:] = [b for b in _quarantine if id(b) not in ids]
    if done:
        _quarantine_holders[:] = [e for e in _quarantine_holders if e[1]]


def release_quarantine() -> None:
    """Every process that could hold a quarantined block is gone (the runtime closed)."""
    _quarantine.clear()
    _quarantine_holders.clear()
