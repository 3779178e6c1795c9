"""The draft worker's wire: shared-memory payload buffers and fixed-size headers over a Unix socket.

Per direction, shared-memory tensors (files under /dev/shm) hold the payloads (int64, and float32 for the
q rows of chain replies); the socket carries only fixed-size int64 headers
[MAGIC, kind, sequence number, payload offset, ints, floats, 0, 0]. Nothing is pickled. Target -> worker
payloads are appended to their buffer and the offset restarts after every reply (the worker handles
messages in order, so a reply proves every earlier payload was read); a payload that does not fit first
waits for a Barrier reply. Worker -> target payloads are only replies, read (and copied) before the next
request.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct

import torch

from rollout_ssd.ssd.messages import MESSAGES, MalformedMessage

MAGIC = 0x55D5_D12A
HEADER = struct.Struct("<8q")


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = sock.recv_into(view[got:])
        if r == 0:
            raise EOFError("peer closed the connection")
        got += r
    return bytes(buf)


@dataclasses.dataclass
class Buffers:
    """Shared payload tensors: to_worker int64, from_worker int64 and float32."""

    to_ints: torch.Tensor
    from_ints: torch.Tensor
    from_floats: torch.Tensor

    @staticmethod
    def sizes(num_slots: int, max_model_len: int, k: int, vocab: int) -> tuple[int, int, int]:
        to_ints = num_slots * (max_model_len + 2 * k + 16) + 4096
        from_ints = num_slots * (k + 8) + 64
        from_floats = max(num_slots * k * vocab, 1)
        return to_ints, from_ints, from_floats

    @classmethod
    def open(cls, directory: str, sizes: tuple[int, int, int]) -> "Buffers":
        names = ("to_ints", "from_ints", "from_floats")
        dtypes = (torch.int64, torch.int64, torch.float32)
        return cls(*(torch.from_file(os.path.join(directory, n), shared=True, size=s, dtype=d)
                     for n, s, d in zip(names, sizes, dtypes)))


def send_header(sock, kind: int, seq: int, offset: int, n_ints: int, n_floats: int) -> None:
    sock.sendall(HEADER.pack(MAGIC, kind, seq, offset, n_ints, n_floats, 0, 0))


def read_header(sock) -> tuple[int, int, int, int, int]:
    magic, kind, seq, offset, n_ints, n_floats, _, _ = HEADER.unpack(recv_exact(sock, HEADER.size))
    if magic != MAGIC or kind not in MESSAGES:
        raise MalformedMessage(f"bad header (magic {magic:#x}, kind {kind})")
    return kind, seq, offset, n_ints, n_floats
