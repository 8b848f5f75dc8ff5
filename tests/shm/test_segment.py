"""Segments: owner-only memfds with no name in /dev/shm, sealed against resizing, and read-only where handed so."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

import pytest

from kvstore.shm.segment import OWNER_ONLY, SEALS, Segment, SegmentError

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs Linux memfd")


def test_a_segment_is_owner_only_sealed_and_in_no_directory() -> None:
    before = set(os.listdir("/dev/shm"))
    segment = Segment.create("kvstore-test", 1 << 20)
    try:
        assert segment.mode() == OWNER_ONLY
        assert fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        assert set(os.listdir("/dev/shm")) == before
        assert os.readlink(f"/proc/self/fd/{segment.fd}").startswith("/memfd:kvstore-test")
    finally:
        segment.close()


def test_its_size_cannot_change_so_no_mapping_can_fault() -> None:
    segment = Segment.create("kvstore-test", 1 << 20)
    try:
        for size in (0, 4096, 2 << 20):
            with pytest.raises(PermissionError):
                os.ftruncate(segment.fd, size)
        segment.view[-1] = 7  # the last byte is still mapped
        assert segment.view[-1] == 7
    finally:
        segment.close()


def test_a_read_only_descriptor_cannot_write_or_map_writable() -> None:
    segment = Segment.create("kvstore-test", 1 << 16)
    fd = segment.read_only_fd()
    try:
        assert os.fstat(fd).st_ino == os.fstat(segment.fd).st_ino
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 1 << 16, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError) as info:
            os.write(fd, b"x")
        assert info.value.errno == errno.EBADF
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)
        reader = Segment.attach(fd, 1 << 16, writable=False)
        segment.view[10:13] = b"abc"
        assert bytes(reader.view[10:13]) == b"abc"  # one memory, two mappings
        with pytest.raises(TypeError):
            reader.view[0] = 1
        reader.close()
    finally:
        segment.close()


def test_attach_refuses_a_file_that_is_not_a_sealed_segment_of_its_size() -> None:
    unsealed = os.memfd_create("kvstore-test-unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 1 << 16)
    with pytest.raises(SegmentError, match="seals"):
        Segment.attach(unsealed, 1 << 16, writable=True)  # closes the descriptor
    segment = Segment.create("kvstore-test", 1 << 16)
    try:
        with pytest.raises(SegmentError, match="not a segment"):
            Segment.attach(os.dup(segment.fd), 1 << 17, writable=False)
    finally:
        segment.close()


def test_a_view_outlives_close_and_the_mapping_goes_with_the_last_reference() -> None:
    segment = Segment.create("kvstore-test-last-view", 1 << 16)
    view = segment.view[:4]
    segment.view[:4] = b"kept"
    segment.close()
    assert bytes(view) == b"kept"  # closing never unmaps under a view
    assert _mapped("kvstore-test-last-view")
    del view, segment
    assert not _mapped("kvstore-test-last-view")


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(f"/memfd:{name}" in line for line in maps)
