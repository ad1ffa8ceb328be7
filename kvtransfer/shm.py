"""Same-host shared memory for KV transfer: the host id, the segments, and the decode
worker's pool of them.

Design: one segment per reservation, owned by the decode worker. A segment is a file under
/dev/shm (tmpfs; mode 0600, so only the same user opens it) sized for the reservation's
whole KV (every layer, K and V), so a transfer never waits for space and never overwrites
bytes the receiver has not consumed. The sender writes each chunk's payload into it,
packed in stream order, and sends only a descriptor (offset, length, layer, block indices,
CRC-32C) on the Push stream; the receiver takes the payload from the segment instead of
the message and validates it exactly as a gRPC payload (`pdserve.kvtransfer.receiver`).

Life cycle of a segment:

    Reserve (decode)        `ShmSegmentPool.offer`: a free segment that fits, or a new one
                            (`pdserve-kv-<pid>-<random>`, created and mapped by the decode
                            worker); its name and size go back in ReserveResponse.shm
    Prefill (prefill)       `ShmSegment.open`: the sender maps it when the host ids match
                            and it opens (gRPC payloads otherwise), and keeps the mapping
                            for the next transfer the pool hands the same segment (see
                            `pdserve.kvtransfer.shm_sender`); it never unlinks one
    commit acked (decode)   `finish(clean=True)`: the engine has copied every chunk (its
                            commit runs after the writes), and the sender wrote its last
                            byte before it sent the commit: the segment goes back to the
                            free list, still mapped, so the next transfer finds its pages
                            allocated and mapped
    any other end (decode)  `finish(clean=False)` (abort, rejection, cancel, expiry, a
                            reservation released before any push): the name is unlinked at
                            once and the pool drops its mapping; the pages go when the
                            last mapping does (an engine write still queued keeps its
                            view). Such a segment is never reused, so a sender that has
                            not noticed the end yet can only write into memory that no
                            other transfer reads.
    worker stop             `close()`: every segment unlinked

Trust: the segment is as private as the user both workers run as. The decode engine
takes a chunk's CRC-32C as it copies the bytes into the reservation's blocks, in one read
(`pdserve.engine.kv_blocks.ingest_blocks`), so the bytes checked are the bytes copied; a
mismatch refuses the stream and aborts the reservation, whose blocks nothing else reads
(`pdserve.kvtransfer.receiver`, Trust). The sender must still not write a chunk's bytes
again once its descriptor is sent (ours never does; any process of that user could, as it
could ptrace either worker): a rewrite racing the copy would be caught only by chance.

Either side dying: if the sender dies, its Push stream breaks, the receiver aborts the
reservation and the segment is unlinked (not clean). If the decode worker dies, its Push
streams fail at the sender, which drops its mappings; the names it left in /dev/shm are
removed by the next pool started on that host (`sweep_stale`: segments whose creator pid
is gone).
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.pids import pid_alive
from pdserve.protos.pdserve.v1 import common_pb2

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "pdserve-kv-"
# the only names a sender opens: a name from the wire never walks out of SHM_DIR
_NAME = re.compile(r"pdserve-kv-(\d+)-[0-9a-f]{16}")
_ROUND_BYTES = 1 << 20  # segment sizes are rounded up to this, so they fit other prompts
DEFAULT_POOL_BYTES = 2 << 30


def kv_bytes(spec: KVCacheSpec, num_blocks: int) -> int:
    """Bytes of a reservation's whole KV: every layer's K and V of `num_blocks` blocks,
    what its segment must hold."""
    return spec.num_layers * 2 * num_blocks * spec.block_bytes


def host_id() -> str | None:
    """This host's identity for the shm handshake: machine id and boot id, hashed (a
    reboot or another machine never matches). None when neither can be read."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            parts.append(Path(path).read_text().strip())
        except OSError:
            parts.append("")
    if not any(parts):
        return None
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ShmOffer:
    """A decode worker's offer for one reservation (`KVShmOffer` in common.proto)."""

    host_id: str
    segment: str
    size: int

    def __post_init__(self) -> None:
        assert self.size > 0, self.size


class ShmSegment:
    """One shared-memory file, mapped read-write in this process.

    Closing drops this object's mapping when nothing else views it; otherwise the last
    view to go unmaps it (a mapping with live views cannot be closed)."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, directory: Path,
                 inode: int = 0) -> None:
        self.name = name
        self.size = size
        self.path = directory / name
        self.inode = inode  # of the file mapped: tells a reused name from a new file
        self._mm: mmap.mmap | None = mm
        self.view = memoryview(mm)

    @classmethod
    def create(cls, size: int, directory: Path = SHM_DIR) -> ShmSegment:
        name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(directory / name)
            raise
        finally:
            os.close(fd)
        return cls(name, size, mm, directory)

    @classmethod
    def open(cls, name: str, size: int, directory: Path = SHM_DIR) -> ShmSegment:
        """Maps an existing segment. Raises ValueError for a name that is not a segment's
        or a size that differs from the file's, OSError when it does not open.

        The pages fault in as the first copy touches them, which costs more than the copy
        itself (100 MB: ~0.5 GB/s copying into a fresh mapping, ~1-1.5 into one whose
        page table is filled), hence senders keep their mappings. MAP_POPULATE would
        move that cost into this call, which runs on the prefill worker's event loop."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"segment: {name!r} is not a pdserve KV segment name")
        fd = os.open(directory / name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_size != size:
                raise ValueError(f"segment: {name} has {st.st_size} bytes, the offer says {size}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, size, mm, directory, st.st_ino)

    def is_current(self) -> bool:
        """Its file still exists under its name: the decode worker has not dropped it."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is None:
            return
        try:
            self.view.release()
            mm.close()
        except BufferError:
            pass  # views handed out (queued engine writes) still read it; they unmap it


def sweep_stale(directory: Path = SHM_DIR) -> int:
    """Unlinks segments whose creating process is gone; returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        try:
            os.unlink(directory / name)
            removed += 1
        except OSError:
            pass
    if removed:
        log.info("removed %d KV segments left by dead processes in %s", removed, directory)
    return removed




class ShmSegmentPool:
    """The decode worker's segments: one per reservation offered shm, plus clean ones kept
    for reuse. `capacity_bytes` bounds all of them together; an offer that does not fit
    returns None and that transfer sends its payloads over gRPC. Thread-safe."""

    def __init__(self, host: str, capacity_bytes: int = DEFAULT_POOL_BYTES,
                 directory: Path = SHM_DIR) -> None:
        self.host_id = host
        self.capacity_bytes = capacity_bytes
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._in_use: dict[str, ShmSegment] = {}  # reservation id -> its segment
        self._free: list[ShmSegment] = []
        sweep_stale(self.directory)

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return self._bytes_held()

    def _bytes_held(self) -> int:
        return sum(s.size for s in (*self._in_use.values(), *self._free))

    @property
    def num_in_use(self) -> int:
        return len(self._in_use)

    def segment_names(self) -> list[str]:
        with self._lock:
            return [s.name for s in (*self._in_use.values(), *self._free)]

    def offer(self, reservation_id: str, nbytes: int) -> ShmOffer | None:
        """A segment of at least `nbytes` for the reservation, or None (no room, or the
        segment could not be created)."""
        if nbytes < 1:
            raise ValueError(f"nbytes must be >= 1, got {nbytes}")
        with self._lock:
            if reservation_id in self._in_use:
                raise ValueError(f"reservation {reservation_id!r} already has a segment")
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
            else:
                seg = self._create(-(-nbytes // _ROUND_BYTES) * _ROUND_BYTES)
                if seg is None:
                    return None
            self._in_use[reservation_id] = seg
            return ShmOffer(self.host_id, seg.name, seg.size)

    def _create(self, size: int) -> ShmSegment | None:
        # make room by dropping free segments, largest first
        self._free.sort(key=lambda s: s.size)
        while self._free and self._bytes_held() + size > self.capacity_bytes:
            self._drop(self._free.pop())
        if self._bytes_held() + size > self.capacity_bytes:
            return None
        try:
            return ShmSegment.create(size, self.directory)
        except OSError as e:
            log.warning("no KV shm segment of %d bytes: %s", size, e)
            return None

    def payload(self, reservation_id: str, offset: int, length: int) -> memoryview | None:
        """The bytes [offset, offset + length) of the reservation's segment; None when the
        reservation has no segment or the range is outside it."""
        seg = self._in_use.get(reservation_id)
        if seg is None or offset + length > seg.size:
            return None
        return seg.view[offset:offset + length]

    def finish(self, reservation_id: str, clean: bool) -> None:
        """The reservation's transfer is over; a no-op when it has no segment. clean: it
        committed and the engine has copied every chunk, so the segment may be reused."""
        with self._lock:
            seg = self._in_use.pop(reservation_id, None)
            if seg is None:
                return
            if clean:
                self._free.append(seg)
            else:
                self._drop(seg)

    def _drop(self, seg: ShmSegment) -> None:
        seg.unlink()
        seg.close()

    def close(self) -> None:
        """Unlinks every segment (worker stop)."""
        with self._lock:
            segs = [*self._in_use.values(), *self._free]
            self._in_use.clear()
            self._free.clear()
        for seg in segs:
            self._drop(seg)


def offer_to_proto(offer: ShmOffer) -> common_pb2.KVShmOffer:
    return common_pb2.KVShmOffer(host_id=offer.host_id, segment=offer.segment, size=offer.size)


def offer_from_proto(msg: common_pb2.KVShmOffer) -> ShmOffer | None:
    """None for an empty or unusable offer (the transfer then goes over gRPC)."""
    if not msg.host_id or not msg.segment or msg.size < 1:
        return None
    return ShmOffer(msg.host_id, msg.segment, msg.size)
