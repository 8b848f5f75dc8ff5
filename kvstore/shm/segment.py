"""Shared-memory segments: sealed ``memfd`` files of a fixed size, created owner-only and mapped by two processes.

A segment is an anonymous file (``memfd_create(2)``), so it has no name in
``/dev/shm`` or anywhere else: it exists while a process holds its file
descriptor or a mapping of it, and nothing is left behind when both processes
are gone, however they end. It reaches the other process only as a file
descriptor passed over a Unix socket (:mod:`kvstore.shm.handoff`); its mode is
owner-only (``0600``), so ``/proc/<pid>/fd`` gives no other user a way in either.
A segment only the node writes (a session's get segment) is made read-only to
everyone else: mode ``0400`` once the node holds it open and mapped, and, where
asked (``seal_writes``), ``F_SEAL_FUTURE_WRITE`` (Linux 5.1+), which no process
can lift, root included. The seal also forbids giving pages back to the kernel
(``MADV_REMOVE`` and hole punching fail with ``EPERM``), so a sealed segment keeps
the pages it was written into until it is closed, where an unsealed one gives
them back range by range (:meth:`Segment.release`); ``docs/shared-memory.md``
weighs the two.

Its size is sealed (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``, see
``memfd_create(2)`` and ``fcntl(2)`` "File Sealing"): a process holding it
writable can change its bytes but never truncate it, so the other side's
mapping can never fault (``SIGBUS``) on a page cut off under it. This is the
use file sealing was added to Linux for (David Herrmann, "memfd: File Sealing",
LWN 591108): memory shared with a process one does not trust.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import socket
import stat
import sys
import weakref

from kvstore.errors import KVStoreError

OWNER_ONLY = 0o600
"""The mode of every segment: read and write for its owner only."""

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if sys.platform == "linux" else 0
"""The seals every segment carries: its size is fixed, and no seal can be added or removed."""

READ_ONLY = 0o400
"""The mode of a segment only its owner's mapping writes (a get segment), once that mapping is made."""

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
"""``fcntl(2)``: no new writable mapping and no ``write(2)``, by anyone; mappings made before keep writing
(Linux 5.1; ``include/uapi/linux/fcntl.h``, the value where Python's ``fcntl`` lacks the name)."""


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
"""``madvise(2)``: fault in a range's pages for reading now (Linux 5.14; ``include/uapi/asm-generic/mman-common.h``)."""
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""``madvise(2)``: fault in a range's pages for writing now (Linux 5.14)."""


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map(fd: int, nbytes: int, writable: bool) -> tuple[int, memoryview]:
    """Map ``fd`` shared: its address, and a byte view that owns the mapping (it is unmapped once neither that view
    nor any view made from it is left).

    ``mmap(2)`` is called directly rather than through Python's ``mmap`` module,
    which keeps a duplicate of the descriptor for as long as the mapping lives
    (``trackfd`` came only in Python 3.13): a segment used through its mapping
    alone must leave no descriptor in ``/proc/<pid>/fd`` for another process of
    the same uid to reopen (:meth:`Segment.drop_descriptor`).

    Raises:
        OSError: if the kernel refuses.
    """
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    address = _libc.mmap(None, nbytes, prot, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    memory = (ctypes.c_ubyte * nbytes).from_address(address)
    weakref.finalize(memory, _libc.munmap, address, nbytes)
    return address, memoryview(memory).cast("B")


def _madvise(address: int, nbytes: int, advice: int) -> None:
    """``madvise(2)`` on ``[address, address + nbytes)``.

    Raises:
        OSError: if the kernel refuses.
    """
    if _libc.madvise(address, nbytes, advice) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


class SegmentError(KVStoreError):
    """A segment cannot be made, or a file descriptor handed over is not a segment this side can use."""


def unsupported_reason() -> str | None:
    """Why this platform has no same-host data plane (``None`` when it has one): it needs Linux's memfd and seals."""
    if sys.platform != "linux":
        return f"shared-memory segments need Linux (memfd_create and file seals); this is {sys.platform}"
    if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return "this Python has no os.memfd_create or socket.send_fds"
    return None


class Segment:
    """One mapped segment of ``nbytes``.

    Made by :meth:`create` (the node) or :meth:`attach` (a client, from a handed-over file descriptor).

    Attributes:
        fd: the file descriptor (owned; closed by :meth:`close`).
        nbytes: size, bytes.
        writable: whether this side mapped it writable.
        view: a ``memoryview`` of the whole mapping (read-only unless ``writable``).
        sealed_writes: whether it carries :data:`F_SEAL_FUTURE_WRITE` (made so by :meth:`create`).
    """

    def __init__(self, fd: int, nbytes: int, *, writable: bool) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.writable = writable
        self._address, view = _map(fd, nbytes, writable)
        self.view = view if writable else view.toreadonly()
        self._close_fd = weakref.finalize(self, os.close, fd)  # also when it is dropped unclosed
        self._closed = False
        self.sealed_writes = False

    @classmethod
    def create(cls, name: str, nbytes: int, *, writable: bool = True, read_only_to_others: bool = False,
               seal_writes: bool = False) -> Segment:
        """A new sealed, owner-only segment of ``nbytes`` (zero-filled; pages are allocated as they are written).

        Args:
            name: a label for ``/proc/<pid>/fd`` and ``/proc/<pid>/maps`` (``memfd:<name>``); not a path.
            nbytes: size, bytes (> 0).
            writable: map it writable on this side (``False`` for a segment only the other side writes).
            read_only_to_others: only this side's mapping writes it: mode :data:`READ_ONLY` once it is mapped,
                so no process of this uid but root can open it for writing without changing its mode first.
            seal_writes: with ``read_only_to_others``, also seal it with :data:`F_SEAL_FUTURE_WRITE`, so that
                no process at all (root included) can write it but through this side's mapping; its pages
                can then not be given back before it is closed (:meth:`release` does nothing).

        Raises:
            SegmentError: if the platform lacks memfd or seals, or the kernel refuses.
        """
        reason = unsupported_reason()
        if reason is not None:
            raise SegmentError(reason)
        if nbytes <= 0:
            raise SegmentError(f"a segment needs a size > 0, got {nbytes}")
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise SegmentError(f"memfd_create refused: {exc}") from exc
        try:
            os.fchmod(fd, OWNER_ONLY)
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS & ~fcntl.F_SEAL_SEAL)
        except OSError as exc:
            os.close(fd)
            raise SegmentError(f"cannot set up a segment of {nbytes} bytes: {exc}") from exc
        try:
            segment = cls(fd, nbytes, writable=writable)
        except OSError as exc:  # the segment owns fd now: its finalizer closes it
            raise SegmentError(f"cannot map a segment of {nbytes} bytes: {exc}") from exc
        sealed = read_only_to_others and seal_writes and writable
        try:  # the mapping exists: a future-write seal leaves it writable, and F_SEAL_SEAL closes the list
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | (F_SEAL_FUTURE_WRITE if sealed else 0))
            if read_only_to_others:
                os.fchmod(fd, READ_ONLY)
        except OSError as exc:
            segment.close()
            raise SegmentError(f"cannot seal a segment of {nbytes} bytes: {exc}") from exc
        segment.sealed_writes = sealed
        return segment

    @classmethod
    def attach(cls, fd: int, nbytes: int, *, writable: bool) -> Segment:
        """Map a segment handed over as ``fd`` (this object owns ``fd`` from now on, also on an error).

        The file must be ``nbytes`` long and carry :data:`SEALS`: a file whose
        size the other side could still change could fault this side's mapping.

        Raises:
            SegmentError: if it is not such a file.
        """
        try:
            info = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if not stat.S_ISREG(info.st_mode) or info.st_size != nbytes:
                raise SegmentError(f"the handed-over file is not a segment of {nbytes} bytes "
                                   f"(mode {info.st_mode:o}, {info.st_size} bytes)")
            if seals & SEALS != SEALS:
                raise SegmentError(f"the handed-over segment lacks its seals ({seals:#x}, needs {SEALS:#x})")
            return cls(fd, nbytes, writable=writable)
        except OSError as exc:
            os.close(fd)
            raise SegmentError(f"cannot map the handed-over segment: {exc}") from exc
        except BaseException:
            os.close(fd)
            raise

    def read_only_fd(self) -> int:
        """A new file descriptor of this segment open for reading only, to hand to the other side.

        Reopened through ``/proc/self/fd`` with ``O_RDONLY``: its holder can map
        the segment only read-only and cannot write it in any other way either.

        Raises:
            SegmentError: if the kernel refuses.
        """
        try:
            return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SegmentError(f"cannot reopen the segment read-only: {exc}") from exc

    def release(self, offset: int, nbytes: int) -> bool:
        """Give the pages of ``[offset, offset + nbytes)`` back to the kernel (``madvise(MADV_REMOVE)``).

        The range reads as zeros afterwards, in every mapping, and takes memory
        again only as it is written. Only whole pages are given back: pass
        page-aligned ranges (:class:`kvstore.shm.allocator.RangeAllocator` hands out such).

        Returns:
            Whether the pages were given back: ``False`` for a segment sealed against writes, one this
            side maps read-only, a closed one, or a kernel that refuses.
        """
        if self.sealed_writes or not self.writable or self.closed or nbytes <= 0:
            return False
        try:
            _madvise(self._address + offset, nbytes, mmap.MADV_REMOVE)
        except (OSError, ValueError):
            return False
        return True

    def populate(self, nbytes: int, *, write: bool = False) -> bool:
        """Map in the pages of ``[0, nbytes)`` now (``madvise(MADV_POPULATE_READ)``, or ``_WRITE``; Linux 5.14), in
        one call rather than a page fault per page on first use. Pages not yet in the file are allocated.

        Returns:
            Whether the kernel did it (``False`` on an older kernel, or a closed segment: pages then fault in as
            they are used).
        """
        nbytes = min(nbytes, self.nbytes)
        if self.closed or nbytes <= 0:
            return False
        try:
            _madvise(self._address, nbytes, MADV_POPULATE_WRITE if write else MADV_POPULATE_READ)
        except (OSError, ValueError):
            return False
        return True

    def resident_bytes(self) -> int:
        """Bytes of memory the segment's pages take now (``st_blocks`` × 512), whoever mapped them; 0 once closed."""
        if not self.has_descriptor:
            return 0
        try:
            return os.fstat(self.fd).st_blocks * 512
        except OSError:
            return 0

    def mode(self) -> int:
        """The file's permission bits (:data:`OWNER_ONLY`, or :data:`READ_ONLY` for one read-only to others)."""
        return stat.S_IMODE(os.fstat(self.fd).st_mode)

    def close(self) -> None:
        """Close this side's file descriptor, and use the segment no more; idempotent.

        The mapping stays until the last reference to this segment, or to a
        view of it, goes (CPython frees it then): a call still copying, or a
        tensor viewing it, keeps it valid. It is never unmapped under a view:
        ``torch.frombuffer`` keeps no buffer export, so an explicit unmap would
        leave such a tensor pointing at nothing.
        """
        self._closed = True
        self._close_fd()

    def drop_descriptor(self) -> None:
        """Close this side's file descriptor but go on using the mapping (idempotent).

        Once neither side holds a descriptor, no other process can open the
        segment: ``/proc/<pid>/fd`` lists none, and ``/proc/<pid>/map_files``
        opens a mapping only for ``CAP_SYS_ADMIN``. :meth:`read_only_fd`,
        :meth:`resident_bytes` and :meth:`mode` need the descriptor.
        """
        self._close_fd()

    @property
    def has_descriptor(self) -> bool:
        """Whether this side still holds the segment's file descriptor."""
        return self._close_fd.alive

    @property
    def closed(self) -> bool:
        """Whether this side is done with the segment (:meth:`close`)."""
        return self._closed

    def __repr__(self) -> str:
        return f"Segment(fd={self.fd}, {self.nbytes} bytes, {'rw' if self.writable else 'ro'})"
