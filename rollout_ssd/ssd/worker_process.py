"""The draft worker process: the SSD draft side (DraftServer) in a fresh interpreter of its own.

Started by ssd/worker_client.py as `python -m rollout_ssd.ssd.worker_process ARGS.json` (a subprocess,
not multiprocessing's spawn: the caller's __main__ is never re-imported), or as `... -`, a spare started
while the engine loads its models, which reads ARGS.json's path from stdin once it has imported. ARGS.json holds plain values
only (paths, sizes, the draft's ModelConfig fields, RoPE frequencies, a tensor manifest); the draft
weights are raw tensor bytes in a shared-memory file the parent wrote, copied from here. On a CPU the
process is pinned to its own core with one intra-op thread, so the draft builds the next cache while the
target verifies on the other core: the two-device picture.

It decodes each message from the wire (ssd/wire.py), lets the server handle it and writes the reply.
Draft weight updates (UpdateDraftWeights) are read from their file in the shared directory and verified
strictly by DraftServer.apply_update between two commands. EOF (the target side went away) ends it
quietly; any other error prints a traceback and exits with code 1 (the target side then falls back).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback

import torch

from rollout_ssd.models.cpu_backend import warm_packed
from rollout_ssd.models.cpu_memory import keep_freed_memory
from rollout_ssd.models.decoder import Decoder
from rollout_ssd.ssd.messages import (
    MESSAGES,
    DraftWeightsReply,
    MalformedMessage,
    Message,
    Ready,
    Shutdown,
    UpdateDraftWeights,
)
from rollout_ssd.ssd.weight_file import read_update
from rollout_ssd.ssd.wire import Buffers, read_header, send_header


def _load_model(args: dict) -> Decoder:
    from rollout_ssd.models.config import ModelConfig
    from rollout_ssd.models.loader import load_state

    cfg_fields = dict(args["model_config"])
    cfg_fields["eos_token_ids"] = tuple(cfg_fields["eos_token_ids"])
    cfg = ModelConfig(**cfg_fields)
    dtype = getattr(torch, args["dtype"])
    model = Decoder(cfg, torch.tensor(args["inv_freq"], dtype=torch.float32), args["rope_scaling"], dtype=dtype)
    total = max(off + n for _, _, _, off, n in args["manifest"]) if args["manifest"] else 1
    raw = torch.from_file(args["weights_path"], shared=False, size=total, dtype=torch.uint8)
    state = {}
    for name, dt, shape, off, nbytes in args["manifest"]:
        state[name] = raw[off: off + nbytes].view(getattr(torch, dt)).view(shape)
    load_state(model, state)
    if args.get("int4_group") is not None:  # the target's own weights as an int4 draft (models/quant.py)
        from rollout_ssd.models.quant import quantize_int4

        quantize_int4(model, args["int4_group"])
    return model.eval()


def worker_main(args: dict) -> None:
    """Entry point of the draft worker process. `args` holds plain values only."""
    from rollout_ssd.ssd.draft_server import DraftServer
    from rollout_ssd.ssd.tree import SaguaroRule

    torch.set_num_threads(1)
    keep_freed_memory()  # as the engine does on a CPU (models/cpu_memory.py)
    if args.get("core") is not None:
        try:
            os.sched_setaffinity(0, {args["core"]})
        except OSError:
            pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(args["socket_path"])
        bufs = Buffers.open(args["directory"], tuple(args["sizes"]))
        model = _load_model(args)
        warm_packed(model)  # this process's own CPU kernels, before its first rounds
        server = DraftServer(model, args["num_slots"], args["max_model_len"], args["k"], args["max_branches"],
                             SaguaroRule(C=args["C"], c_min=args["c_min"]), draft_version=args.get("draft_version", 0))
        _reply(sock, bufs, Ready(os.getpid()), 0)
        while True:
            kind, seq, offset, n_ints, n_floats = read_header(sock)
            if offset < 0 or n_ints < 0 or offset + n_ints > bufs.to_ints.numel() or n_floats != 0:
                raise MalformedMessage("payload outside the shared buffer")
            ints = bufs.to_ints[offset: offset + n_ints].tolist()
            msg = MESSAGES[kind].decode(ints, None)
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, UpdateDraftWeights):
                reply = _apply_update(server, args["directory"], msg)
            else:
                reply = server.handle(msg)
            if reply is not None:
                _reply(sock, bufs, reply, seq)
    except EOFError:
        pass  # the target side went away: nothing left to do
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    finally:
        sock.close()


def _apply_update(server, directory: str, msg: UpdateDraftWeights) -> DraftWeightsReply:
    """Read the transfer's file and let the server verify and apply it; a missing or mis-sized file is a
    rejection like any other."""
    try:
        packet = read_update(directory, msg)
    except (OSError, MalformedMessage, RuntimeError) as err:
        print(f"draft worker: weight update {msg.transfer} rejected: {err}", file=sys.stderr, flush=True)
        return DraftWeightsReply(False, server.transfer, server.draft_version, 0)
    reply = server.apply_update(packet, msg)
    if not reply.accepted:
        print(f"draft worker: weight update {msg.transfer} rejected: {server.last_error}", file=sys.stderr, flush=True)
    return reply


def _reply(sock, bufs: Buffers, msg: Message, seq: int) -> None:
    ints, floats = msg.encode()
    n_floats = 0 if floats is None else floats.numel()
    if len(ints) > bufs.from_ints.numel() or n_floats > bufs.from_floats.numel():
        raise MalformedMessage("reply does not fit the shared buffer")
    bufs.from_ints[: len(ints)] = torch.tensor(ints, dtype=torch.int64)
    if n_floats:
        bufs.from_floats[:n_floats] = floats
    send_header(sock, msg.KIND, seq, 0, len(ints), n_floats)


if __name__ == "__main__":
    if sys.argv[1] == "-":  # a spare (worker_client.prestart): imported, it waits for its args file's path
        from rollout_ssd.ssd import draft_server, tree  # noqa: F401  (worker_main's, imported while waiting)

        _path = sys.stdin.readline().strip()
        if not _path:
            sys.exit(0)  # dismissed, or its parent is gone
    else:
        _path = sys.argv[1]
    with open(_path) as _f:
        worker_main(json.load(_f))
