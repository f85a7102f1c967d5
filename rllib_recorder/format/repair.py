"""Repairs below h5py: make a killed writer's last bytes addressable again (the superblock's end-of-allocation).

HDF5 writes a chunk's bytes past the end of the allocated space, then its index entries and the superblock,
whose end-of-allocation address (EOA) says how far the file's allocated space goes. A writer killed between
the index and the superblock leaves an index that points past the recorded EOA: every read of that chunk
fails with "addr overflow", although its bytes are in the file. Worse, opening such a file for writing makes
HDF5 truncate it to the stale EOA on close, destroying those bytes. ``extend_eoa_to_eof`` moves the EOA to the
file's real end first, like ``h5clear --increment`` (HDF5's own tool for files left by a crashed writer).
Bytes past the old EOA become allocated-but-unused space when no index points at them. Only used on files no
live process is writing: a writer reopening its file, and ``rllib-recorder recover``.
"""

from __future__ import annotations

import os

SIGNATURE = b"\x89HDF\r\n\x1a\n"
# Superblock version -> byte offset of the EOA field (8-byte offsets), from the HDF5 file format spec.
_EOA_OFFSET = {0: 40, 1: 44, 2: 28, 3: 28}
_CHECKSUMMED = (2, 3)  # versions 2 and 3 end the superblock (at EOA offset + 16) with a lookup3 checksum


def extend_eoa_to_eof(path: str) -> int:
    """Sets the superblock's EOA to the file's size if that is larger; returns the bytes made addressable."""
    with open(path, "r+b") as f:
        head = f.read(48)
        if len(head) < 48 or head[:8] != SIGNATURE or head[8] not in _EOA_OFFSET:
            return 0  # not a superblock at offset 0 we know: leave the file to h5py's own checks
        version = head[8]
        size_of_offsets = head[9] if version in _CHECKSUMMED else head[13]
        if size_of_offsets != 8:
            return 0
        at = _EOA_OFFSET[version]
        eoa = int.from_bytes(head[at:at + 8], "little")
        eof = os.fstat(f.fileno()).st_size
        if eof <= eoa:
            return 0
        patched = bytearray(head)
        patched[at:at + 8] = eof.to_bytes(8, "little")
        if version in _CHECKSUMMED:
            end = at + 16  # EOA, then the root group's object header address, then the checksum
            patched[end:end + 4] = lookup3(bytes(patched[:end])).to_bytes(4, "little")
        f.seek(0)
        f.write(patched)
        f.flush()
        os.fsync(f.fileno())
    return eof - eoa


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & 0xFFFFFFFF


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle``, the checksum HDF5 puts on superblocks of version 2 and 3."""
    mask = 0xFFFFFFFF
    length = len(data)
    a = b = c = (0xDEADBEEF + length + initval) & mask
    i = 0
    while length > 12:
        a = (a + int.from_bytes(data[i:i + 4], "little")) & mask
        b = (b + int.from_bytes(data[i + 4:i + 8], "little")) & mask
        c = (c + int.from_bytes(data[i + 8:i + 12], "little")) & mask
        a = ((a - c) & mask) ^ _rot(c, 4)
        c = (c + b) & mask
        b = ((b - a) & mask) ^ _rot(a, 6)
        a = (a + c) & mask
        c = ((c - b) & mask) ^ _rot(b, 8)
        b = (b + a) & mask
        a = ((a - c) & mask) ^ _rot(c, 16)
        c = (c + b) & mask
        b = ((b - a) & mask) ^ _rot(a, 19)
        a = (a + c) & mask
        c = ((c - b) & mask) ^ _rot(b, 4)
        b = (b + a) & mask
        i += 12
        length -= 12
    if length == 0:
        return c
    tail = data[i:] + bytes(12 - length)
    a = (a + int.from_bytes(tail[0:4], "little")) & mask
    b = (b + int.from_bytes(tail[4:8], "little")) & mask
    c = (c + int.from_bytes(tail[8:12], "little")) & mask
    c = (c ^ b) - _rot(b, 14) & mask
    a = (a ^ c) - _rot(c, 11) & mask
    b = (b ^ a) - _rot(a, 25) & mask
    c = (c ^ b) - _rot(b, 16) & mask
    a = (a ^ c) - _rot(c, 4) & mask
    b = (b ^ a) - _rot(a, 14) & mask
    c = (c ^ b) - _rot(b, 24) & mask
    return c
