"""A connection's lease ledger (``_ledger``), with no process and no socket."""

import gc

import pytest

from actorshm import _leases, _shm
from actorshm._ledger import Ledger


class _Enc:
    """What ``Ledger.commit`` reads of an encoder."""

    def __init__(self, blocks, new_regions=()):
        self.grants = list(blocks)
        self.new_regions = list(new_regions)


class _Channel:
    label = "peer"
    closed = False


@pytest.fixture
def block():
    b = _shm.pool().alloc(1000)
    yield b
    del b
    gc.collect()


def test_each_message_is_one_grant_and_the_block_lives_until_all_come_back(block):
    ledger, ch = Ledger(), _Channel()
    ledger.commit(_Enc([block]), ch)
    ledger.commit(_Enc([block]), ch)
    assert ledger.grants[block.key].count == 2
    assert ledger.grants[block.key].block is block
    ledger.apply([(block.key, 1)])
    assert ledger.grants[block.key].count == 1
    ledger.apply([(block.key, 1)])
    assert block.key not in ledger.grants


def test_a_release_of_an_unknown_block_is_ignored(block):
    ledger = Ledger()
    ledger.commit(_Enc([block]), _Channel())
    ledger.apply([((1, 2, 3), 5)])
    assert ledger.grants[block.key].count == 1


def test_introduced_regions_are_remembered_on_both_sides(block):
    ledger, ch = Ledger(), _Channel()
    ledger.commit(_Enc([block], [block.region]), ch)
    assert block.region.key in ledger.sent_regions
    assert ch in block.region.sent_to
    block.region.sent_to.discard(ch)


def test_closing_keeps_blocks_the_peer_passed_on(block):
    ledger = Ledger()
    ledger.commit(_Enc([block]), _Channel())
    ledger.apply([], [(block.key, 1)])  # the peer passed it on
    assert ledger.grants[block.key].forwarded == 1
    n0 = _leases.quarantined()
    try:
        assert ledger.settle(peer_gone=True) == 1
        assert _leases.quarantined() == n0 + 1
        assert not ledger.grants
    finally:
        _leases.release_quarantine()


def test_closing_lets_go_of_blocks_the_peer_did_not_pass_on(block):
    ledger = Ledger()
    ledger.commit(_Enc([block]), _Channel())
    n0 = _leases.quarantined()
    assert ledger.settle(peer_gone=True) == 0
    assert _leases.quarantined() == n0 and not ledger.grants


def test_count_picks_grants(block):
    ledger = Ledger()
    ledger.commit(_Enc([block]), _Channel())
    assert ledger.count(lambda g: g.count == 1) == 1
    assert ledger.count(lambda g: g.told) == 0
