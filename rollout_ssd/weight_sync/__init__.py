"""Weight sync from a learner: full and exact-delta transfers with versions. Depends only on torch.

A learner builds a `WeightSender` over a transport and calls `sync(named_tensors, version)` (or `send`
then `wait_ack`); a rollout process builds a `WeightReceiver` over the matching transport, calls
`receive()` to get a verified `StagedUpdate`, and `apply_to(params)` between rounds. Nothing is pickled:
a transfer is a JSON manifest plus uint8 buckets, both sent as tensors.

    codec.py        full / exact-delta encoding, bucket packing, checksums, strict decoding
    mix64.py        splitmix64 on int64 tensors (the sum64 checksum; also the SSD draft's uniforms)
    manifest.py     the per-transfer manifest (JSON) and its strict parser
    sender.py       WeightSender, SenderConfig, TransferStats (commit on acknowledgement)
    receiver.py     WeightReceiver, StagedUpdate, ReceiverConfig, ReceiveStats
    transport.py    the Transport interface, Packet, Ack
    in_process.py   InProcessTransport (same process, zero-copy)
    distributed.py  DistributedTransport (torch.distributed broadcast, gloo or NCCL)
    learner.py      LearnerSync: the learner's senders for the target and the draft, stats per sync
"""

from .distributed import DistributedTransport
from .errors import TransportError, TransportTimeout, WeightSyncError
from .in_process import InProcessTransport
from .learner import LearnerSync
from .receiver import ReceiverConfig, ReceiveStats, StagedUpdate, WeightReceiver
from .sender import SenderConfig, TransferStats, WeightSender
from .transport import Ack, Packet, Transport

__all__ = [
    "Ack", "DistributedTransport", "InProcessTransport", "LearnerSync", "Packet", "ReceiveStats", "ReceiverConfig",
    "SenderConfig", "StagedUpdate", "TransferStats", "Transport", "TransportError", "TransportTimeout",
    "WeightReceiver", "WeightSender", "WeightSyncError",
]
