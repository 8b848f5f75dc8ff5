"""The delete records that keep background copies to and from the shared tier from undoing a delete."""

from __future__ import annotations

import pytest

from kvstore.keys import Namespace, block_key
from kvstore.tombstones import Tombstones

NS = Namespace("m")
A, B, C = (block_key(NS, bytes([i]) * 16) for i in range(3))


def test_a_delete_counts_only_for_windows_open_before_it() -> None:
    tombstones = Tombstones()
    early = tombstones.begin()
    tombstones.record_delete([A])
    tombstones.record_delete([A], ended=True)
    late = tombstones.begin()
    assert tombstones.deleted_since(A, early) and not tombstones.deleted_since(A, late)
    assert not tombstones.deleted_since(B, early)


def test_a_delete_in_progress_counts_for_every_copy_but_only_for_puts_that_began_before_it() -> None:
    tombstones = Tombstones()
    put_before = tombstones.begin()
    tombstones.record_delete([A])
    put_after = tombstones.begin()  # a put made after the delete began (and forgot its blocks): the newer
    assert tombstones.deleted_since(A, put_after)  # a copy may have read the block before the delete's DEL
    assert tombstones.delete_began_since(A, put_before) and not tombstones.delete_began_since(A, put_after)
    tombstones.record_delete([A], ended=True)
    assert tombstones.deleted_since(A, put_after)  # it ended after the window began
    assert not tombstones.delete_began_since(A, put_after)
    assert not tombstones.deleted_since(A, tombstones.begin())


def test_a_clear_covers_every_key_of_its_namespace_only() -> None:
    tombstones = Tombstones()
    window = tombstones.begin()
    tombstones.record_clear(NS.tag)
    other = block_key(Namespace("other"), b"\0" * 16)
    assert tombstones.deleted_since(A, window) and tombstones.deleted_since(C, window)
    assert tombstones.delete_began_since(A, window)
    assert not tombstones.deleted_since(other, window)
    tombstones.record_clear(NS.tag, ended=True)
    assert not tombstones.deleted_since(A, tombstones.begin())


def test_nothing_is_recorded_without_an_open_window_and_records_go_with_the_windows_that_need_them() -> None:
    tombstones = Tombstones()
    tombstones.record_delete([A, B])
    tombstones.record_delete([A, B], ended=True)
    assert len(tombstones) == 0
    first = tombstones.begin()
    tombstones.record_delete([A])
    tombstones.record_delete([A], ended=True)
    second = tombstones.begin()
    tombstones.record_delete([B])
    tombstones.record_delete([B], ended=True)
    tombstones.record_clear(NS.tag)
    tombstones.record_clear(NS.tag, ended=True)
    assert len(tombstones) == 3
    tombstones.end(first)  # A's record concerned only the first window
    assert len(tombstones) == 2 and tombstones.deleted_since(B, second)
    tombstones.end(second)
    assert len(tombstones) == 0


def test_deletes_in_progress_are_counted_until_each_ends() -> None:
    tombstones = Tombstones()
    tombstones.record_delete([A])
    tombstones.record_delete([A, B])
    assert len(tombstones) == 2  # in progress, with no window open
    tombstones.record_delete([A], ended=True)
    assert tombstones.deleted_since(A, tombstones.begin())
    tombstones.record_delete([A, B], ended=True)
    assert not tombstones.deleted_since(A, tombstones.begin())
    with pytest.raises(KeyError):
        tombstones.record_delete([A], ended=True)


def test_windows_of_one_epoch_are_counted() -> None:
    tombstones = Tombstones()
    one, two = tombstones.begin(), tombstones.begin()
    assert one == two
    tombstones.record_delete([A])
    tombstones.record_delete([A], ended=True)
    tombstones.end(one)
    assert tombstones.deleted_since(A, two) and len(tombstones) == 1
    tombstones.end(two)
    assert len(tombstones) == 0
    with pytest.raises(KeyError):
        tombstones.end(two)


def test_a_shared_window_stays_open_until_both_holders_end_it() -> None:
    tombstones = Tombstones()
    window = tombstones.begin()
    tombstones.record_delete([A])
    tombstones.record_delete([A], ended=True)
    tombstones.share(window)  # a background task takes over part of the copy
    tombstones.end(window)
    assert tombstones.deleted_since(A, window) and len(tombstones) == 1
    tombstones.end(window)
    assert len(tombstones) == 0
    with pytest.raises(KeyError):
        tombstones.share(window)
