"""A short soak: restartable actors under load, SIGKILLs and respawns; afterwards the
driver's fds, arenas and live blocks are back where they started. ``--soak-seconds N``
runs it longer (``python -m benchmarks.soak`` prints the resource table)."""

import asyncio
import gc

import pytest

import actorshm
from benchmarks import soak


@pytest.mark.soak
async def test_soak_leaves_resources_flat(request):
    seconds = request.config.getoption("--soak-seconds")
    rows = []
    async with actorshm.Runtime(shutdown_grace=1.0):
        # Warm-up: the connections, actors and pools a run needs exist from here on.
        await soak.soak(0.5, every=3600, n_actors=3, in_flight=8, max_bytes=1 << 20)
        before = soak.drained()
        out = await soak.soak(seconds, every=max(1.0, seconds / 4), n_actors=3,
                              in_flight=8, max_bytes=8 << 20, on_row=rows.append)
        assert out["ops"] > 0 and out["kills"] > 0
        del out
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while True:  # releases from the killed and stopped actors arrive asynchronously
            after = soak.drained()
            if (after["blocks_live"] == 0 and after["arenas_owned"] <= before["arenas_owned"]
                    and after["fds"] <= before["fds"]) or loop.time() > deadline:
                break
            await asyncio.sleep(0.05)
    assert after["blocks_live"] == 0, (before, after, rows)
    assert after["arenas_owned"] <= before["arenas_owned"], (before, after, rows)
    assert after["fds"] <= before["fds"], (before, after, rows)
    gc.collect()
