"""What Ray users write that actorshm spells another way: the words of the errors that
say how (``actorshm.get``, ``Cls.options(runtime_env=...)``, ``m.options(num_returns=2)``).

Each entry is the advice alone; the callers put it in the error of the name that was
missing. Plain text, no imports: every layer may use it.
"""

from __future__ import annotations

# ``actorshm.<name>`` for Ray's ``ray.<name>``.
MODULE = {
    "remote": "`@actorshm.actor` decorates an actor class (Ray's `@ray.remote`); start one "
              "with `await Cls.spawn(*args)`",
    "get": "a call's result is awaited: `await handle.method(...)` (Ray's `ray.get`); "
           "several at once: `await asyncio.gather(*calls)`",
    "wait": "calls are asyncio awaitables: `done, pending = await asyncio.wait(calls, "
            "timeout=..., return_when=asyncio.FIRST_COMPLETED)` (Ray's `ray.wait`; "
            "`asyncio.wait` leaves the calls it did not wait for running)",
    "put": "share an array once, `a = actorshm.share(array)` (`actorshm.torch.share(t)` "
           "for a tensor), and pass `a` to calls: it travels by reference (Ray's `ray.put`)",
    "kill": "`await handle.kill()` (Ray's `ray.kill`)",
    "cancel": "cancel the call's awaitable, `fut.cancel()` or `asyncio.wait_for(fut, t)`: "
              "the actor drops or interrupts it (Ray's `ray.cancel`)",
    "init": "open a runtime, `async with actorshm.Runtime():`, or run `actorshm.run(main())` "
            "(Ray's `ray.init`; on Ray: `actorshm.Runtime(backend='ray', ...)`)",
    "shutdown": "a runtime closes as its `async with` block ends, or with `await rt.close()` "
                "(Ray's `ray.shutdown`)",
    "method": "there are no per-method options but `run_ahead` for streaming methods: a "
              "method returns one result (return a tuple for several), and "
              "`max_concurrency` is the actor's (Ray's `@ray.method`)",
}

# Actor options of Ray's that actorshm has not (``Cls.options(...)``, ``@actor(...)``).
OPTIONS = {
    "runtime_env": "environment variables go in `env={...}` (a runtime_env's env_vars); an "
                   "actor runs the driver's Python with the driver's import path",
    "max_task_retries": "a call runs at most once: after the actor restarts "
                        "(max_restarts), the calls that were in flight fail with "
                        "ActorDiedError; retry them yourself",
    "lifetime": "an actor lives until `await handle.kill()` or until its runtime closes "
                "(dropping its handles does not end it; nothing outlives the runtime)",
    "namespace": "names are per runtime: `await actorshm.get_actor(name)` finds the named "
                 "actors of the runtime it runs in",
    "get_if_exists": "look it up first, `await actorshm.get_actor(name)`, and spawn it on "
                     "ValueError",
    "concurrency_groups": "an actor has one `max_concurrency` (async methods interleave up "
                          "to it; sync ones run in threads when it is above 1)",
    "resources": "actors run on this machine (CPUs: `num_cpus`, GPUs: `num_gpus`); custom "
                 "resources need Ray itself",
    "scheduling_strategy": "actors run on this machine, or where Ray places them on the Ray "
                           "backend",
    "memory": "an actor's shared memory comes from the runtime's budget, "
              "`actorshm.Runtime(shm_budget=...)`",
}

# Call options of Ray's (``handle.method.options(...)``).
METHOD_OPTIONS = {
    "num_returns": "a method returns one result: return a tuple and unpack it (`a, b = "
                   "await handle.method(...)`); a generator method streams its items "
                   "(`async for item in handle.method(...)`)",
    "concurrency_group": "an actor has one `max_concurrency`, set when it is spawned",
    "name": "a call has no name of its own",
}


def advice(table: dict, names) -> str:
    """The advice ``table`` has for any of ``names``, one sentence each, or ""."""
    said = [f"{n}: {table[n]}" for n in sorted(names) if table.get(n)]
    return (" (" + "; ".join(said) + ")") if said else ""
