"""Errors of the weight-sync layer.

`WeightSyncError` is a `ValueError`: a transfer was rejected because its content is wrong (unknown name,
shape, dtype, non-finite value, stale version, checksum mismatch). The receiver's state is untouched.
`TransportError` is a `WeightSyncError` raised when the stream itself failed (peer died, timeout,
truncated or malformed header): whatever was staged is discarded, and a distributed transport that
raised it must be re-created on a fresh process group.
"""


class WeightSyncError(ValueError):
    """A weight transfer was rejected; the message names the offending tensor or field."""


class TransportError(WeightSyncError):
    """The byte stream failed (timeout, dead peer, truncated or malformed stream)."""


class TransportTimeout(TransportError):
    """Nothing (or not everything) arrived within the timeout."""
