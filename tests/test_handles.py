"""Handles: attributes are methods, including names the handle also uses."""

import pytest

import actorshm
from actors import Counter, Named


async def test_methods_named_name_and_actor_id_win_over_handle_properties(rt):
    n = await Named.options(name="svc").spawn("mine")
    assert await n.name() == "mine"
    assert await n.actor_id() == 42
    c = await Counter.options(name="ctr").spawn(0)
    assert c.name == "ctr" and isinstance(c.actor_id, int)


async def test_unknown_attribute_lists_the_methods(rt):
    c = await Counter.spawn(0)
    with pytest.raises(AttributeError, match="incr"):
        c.no_such_method
    assert "incr" in dir(c)
    assert isinstance(c, actorshm.ActorHandle)
