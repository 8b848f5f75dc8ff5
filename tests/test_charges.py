"""NamespaceCharges as pure logic: each block charged by its length as put, whatever the order of comings and goings."""

from __future__ import annotations

import random

from kvstore.store.charges import NamespaceCharges

TAG_A, TAG_B = b"tag-aaaa", b"tag-bbbb"


def key(tag: bytes, i: int) -> bytes:
    return tag + i.to_bytes(16, "big")


def pages(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096


def test_like_blocks_cost_nothing_per_block_and_odd_ones_are_counted_exactly() -> None:
    charges = NamespaceCharges(pages)
    for i in range(100):
        charges.added(key(TAG_A, i), 5000)
    assert charges.namespace_bytes(TAG_A) == 100 * 8192 and charges.num_odd() == 0
    charges.added(key(TAG_A, 100), 100)  # a small block among large ones
    charges.added(key(TAG_A, 101), 9000)
    assert charges.namespace_bytes(TAG_A) == 100 * 8192 + 4096 + 12288 and charges.num_odd() == 2
    charges.removed(key(TAG_A, 100))
    assert charges.namespace_bytes(TAG_A) == 100 * 8192 + 12288 and charges.num_odd() == 1
    for i in [*range(100), 101]:
        charges.removed(key(TAG_A, i))
    assert charges.namespace_bytes(TAG_A) == 0 and charges.num_odd() == 0
    charges.removed(key(TAG_A, 5))  # never added (or gone already): nothing to give back
    assert charges.namespace_bytes(TAG_A) == 0


def test_random_comings_and_goings_of_mixed_lengths_match_a_recount() -> None:
    rng = random.Random(7)
    charges = NamespaceCharges(pages)
    resident: dict[bytes, int] = {}
    for step in range(5000):
        if resident and rng.random() < 0.45:
            gone = rng.choice(list(resident))
            del resident[gone]
            charges.removed(gone)
        else:
            k = key(rng.choice((TAG_A, TAG_B)), step)
            resident[k] = rng.choice((4000, 4000, 4000, 8000, 100))
            charges.added(k, resident[k])
        if step % 500 == 0:
            for tag in (TAG_A, TAG_B):
                assert charges.namespace_bytes(tag) == sum(pages(n) for k, n in resident.items() if k.startswith(tag))
    for k in list(resident):
        charges.removed(k)
    assert charges.namespace_bytes(TAG_A) == charges.namespace_bytes(TAG_B) == 0 and charges.num_odd() == 0


def test_a_move_is_a_removal_and_an_arrival_of_the_same_length() -> None:
    charges = NamespaceCharges()
    charges.added(key(TAG_B, 1), 700)
    charges.added(key(TAG_B, 2), 900)
    charges.removed(key(TAG_B, 2))  # leaves memory...
    charges.added(key(TAG_B, 2), 900)  # ... and arrives on disk
    assert charges.namespace_bytes(TAG_B) == 1600
