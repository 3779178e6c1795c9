"""Draft weight transfers to the worker process: a weight_sync transfer in a file of the worker's
shared-memory directory, announced by an UpdateDraftWeights header (ssd/messages.py).

The target side keeps its own copy of the draft; `write_update` encodes what changed against what the
worker holds (exact XOR deltas where the previous values are known, else full tensors; per-tensor and
per-bucket checksums, a JSON manifest, never a pickle) into `draft_update.<transfer>`: the manifest at
offset 0, then each bucket at the next 64-byte boundary. `read_update` maps exactly the announced size
back into a weight_sync Packet, which DraftServer.apply_update verifies strictly before applying.
Transfers are numbered 1, 2, ... per worker; a delta's base is the transfer before it.
"""

from __future__ import annotations

import os

import torch

from rollout_ssd.ssd.messages import MalformedMessage, UpdateDraftWeights
from rollout_ssd.weight_sync import Packet
from rollout_ssd.weight_sync.codec import checksum, encode_tensor, pack


def update_path(directory: str, transfer: int) -> str:
    return os.path.join(directory, f"draft_update.{int(transfer)}")


def write_update(directory: str, transfer: int, draft_version: int, new: dict[str, torch.Tensor],
                 old: dict[str, torch.Tensor]) -> UpdateDraftWeights:
    """Encode `new` (name -> tensor; deltas against `old[name]` where given) and write the file; returns
    the header to send. Raises OSError if the file cannot be written."""
    encoded = []
    for name, tensor in new.items():
        t = tensor.detach().contiguous().cpu()
        base = old.get(name)
        base = None if base is None else base.detach().contiguous().cpu()
        encoded.append(encode_tensor(name, t, base, checksum(base) if base is not None else "",
                                     max_delta_share=0.5, compression="none", level=0))
    has_delta = any(e.entry.encoding == "delta" for e in encoded)
    manifest, buckets = pack(encoded, transfer, transfer - 1 if has_delta else None, 1 << 40, torch.device("cpu"))
    head = manifest.to_bytes()
    msg = UpdateDraftWeights(transfer, int(draft_version), len(head), tuple(b.numel() for b in buckets))
    offsets, total = msg.layout()
    with open(update_path(directory, transfer), "wb") as f:
        f.write(head)
        for offset, bucket in zip(offsets, buckets):
            f.seek(offset)
            f.write(bucket.numpy())
        f.truncate(total)
    return msg


def read_update(directory: str, msg: UpdateDraftWeights) -> Packet:
    """The transfer `msg` announces, from its file; raises MalformedMessage (or OSError) when the file
    is missing or not exactly the announced size."""
    offsets, total = msg.layout()
    path = update_path(directory, msg.transfer)
    size = os.path.getsize(path)
    if size != total:
        raise MalformedMessage(f"{path} has {size} bytes, the header says {total}")
    raw = torch.from_file(path, shared=False, size=total, dtype=torch.uint8)
    return Packet(version=msg.transfer, manifest=raw[: msg.manifest_nbytes],
                  buckets=tuple(raw[o: o + n] for o, n in zip(offsets, msg.bucket_nbytes)))
