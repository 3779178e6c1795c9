"""The target side's client of the draft worker process (ssd/worker_process.py).

`WorkerClient.start` writes the draft's weights into a shared-memory file, opens the shared payload
buffers and a Unix socket (ssd/wire.py), and starts the worker as a fresh interpreter
(`python -m rollout_ssd.ssd.worker_process ARGS.json`, through subprocess: unlike multiprocessing's spawn
it never re-imports the caller's __main__, so scripts without a main guard and notebooks work). On a CPU
the two processes are pinned to different cores (os.sched_setaffinity) with one intra-op thread each;
rounds that leave the worker idle give the target both (ssd/cores.py).

Draft weights: `update_weights` writes the changed tensors as a weight_sync transfer into a file of the
shared directory (ssd/weight_file.py) and sends an UpdateDraftWeights header with its sizes. The worker
verifies it strictly (DraftServer.apply_update) between two commands, applies it, drops what the old
weights built, and acknowledges; a rejection is a WorkerFailure (the target side falls back).

Faults: every wait has a timeout (startup_timeout, then worker_timeout); a timeout, EOF, socket error or
malformed reply raises WorkerFailure. close() (and weakref.finalize at garbage collection or interpreter
exit) sends Shutdown, joins with a timeout, then terminates and kills, and removes the shared files.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Optional

import torch

from rollout_ssd.models.decoder import Decoder
from rollout_ssd.ssd.client import DraftClient, WorkerFailure
from rollout_ssd.ssd.config import SSDConfig
from rollout_ssd.ssd.cores import TargetCores, split_for_worker
from rollout_ssd.ssd.messages import (
    REPLIES,
    Barrier,
    DraftDigest,
    DraftWeightsReply,
    MalformedMessage,
    Message,
    Ready,
    Shutdown,
)
from rollout_ssd.ssd.weight_file import update_path, write_update
from rollout_ssd.ssd.wire import Buffers, read_header, send_header

log = logging.getLogger(__name__)


def _write_weights(model: Decoder, path: str) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """Every HF-named tensor of the draft into one file, 64-byte aligned; returns the manifest."""
    manifest, offset = [], 0
    params = model.hf_parameters()
    for name, t in params.items():
        nbytes = t.numel() * t.element_size()
        manifest.append((name, str(t.dtype).replace("torch.", ""), tuple(t.shape), offset, nbytes))
        offset += (nbytes + 63) // 64 * 64
    buf = torch.from_file(path, shared=True, size=max(offset, 1), dtype=torch.uint8)
    for (_, _, _, off, nbytes), t in zip(manifest, params.values()):
        buf[off: off + nbytes].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
    return manifest



class _WorkerProcess:
    """The worker as `python -m rollout_ssd.ssd.worker_process ARGS.json`, with the few Process methods we
    use; without `args_path`, a spare that imports and then waits for its args file's path (`hand`)."""

    def __init__(self, args_path: Optional[str] = None):
        env = dict(os.environ)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._popen = subprocess.Popen([sys.executable, "-m", "rollout_ssd.ssd.worker_process", args_path or "-"],
                                       stdin=subprocess.DEVNULL if args_path else subprocess.PIPE, env=env)
        self.pid = self._popen.pid

    def hand(self, args_path: str) -> None:
        """A spare's args (OSError where it is gone)."""
        self._popen.stdin.write((args_path + "\n").encode())
        self._popen.stdin.close()

    def dismiss(self) -> None:
        """End a spare that was not taken: it reads end-of-file and exits; killed if it does not."""
        if self._popen.stdin is not None and not self._popen.stdin.closed:
            try:
                self._popen.stdin.close()
            except OSError:
                pass
        self.join(timeout=3.0)
        self.kill()
        self.join(timeout=3.0)

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> Optional[int]:
        return self._popen.poll()

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self._popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()


_spare: Optional[_WorkerProcess] = None  # a worker interpreter started ahead of its engine (`prestart`)
_spare_lock = threading.Lock()


def prestart() -> None:
    """Start a worker interpreter now, so that it imports while the caller loads its models (on another
    core): the next `WorkerClient.start` in this process hands it its arguments instead of starting one
    (1.3-1.5 s of an SSD engine's start on a CPU, bench/RESULTS.md). `dismiss_spare` ends one that was not
    taken (`RolloutEngine.from_pretrained` does when it returns or fails); one whose parent exits reads
    end-of-file and exits."""
    global _spare
    with _spare_lock:
        if _spare is None or not _spare.is_alive():
            _spare = _WorkerProcess()


def _take_spare() -> Optional[_WorkerProcess]:
    global _spare
    with _spare_lock:
        proc, _spare = _spare, None
    return proc if proc is not None and proc.is_alive() else None


def dismiss_spare() -> None:
    proc = _take_spare()
    if proc is not None:
        proc.dismiss()


atexit.register(dismiss_spare)


class _Resources:
    """Everything a worker holds, released exactly once (close() or weakref.finalize)."""

    def __init__(self):
        self.proc = None
        self.sock: Optional[socket.socket] = None
        self.listener: Optional[socket.socket] = None
        self.directory: Optional[str] = None
        self.cores: Optional[TargetCores] = None  # the target's CPU share beside the worker
        self.done = False
        self.graceful = True  # False once the worker failed: do not wait for it

    def release(self) -> None:
        if self.done:
            return
        self.done = True
        proc, sock = self.proc, self.sock
        if not self.graceful and proc is not None and proc.is_alive():
            proc.kill()
        if sock is not None and proc is not None and proc.is_alive():
            try:
                sock.settimeout(1.0)
                send_header(sock, Shutdown.KIND, 0, 0, 0, 0)
            except OSError:
                pass
        if proc is not None:
            proc.join(timeout=3.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=3.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=3.0)
        for s in (sock, self.listener):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self.cores is not None:
            self.cores.widen()


class WorkerClient(DraftClient):
    in_process = False

    def __init__(self, resources: _Resources, bufs: Buffers, timeout: float):
        self._res = resources
        self._transfer = 0  # draft weight transfers sent (the worker has applied all of them)
        self.weight_bytes = 0  # bytes of draft weight transfers written for the worker
        self._bufs = bufs
        self._timeout = timeout
        self._offset = 0
        self._seq = 0
        self._dead: Optional[str] = None
        self._finalizer = weakref.finalize(self, resources.release)

    @property
    def pid(self) -> Optional[int]:
        return self._res.proc.pid if self._res.proc is not None else None

    @property
    def process(self):
        return self._res.proc

    @property
    def cores(self) -> Optional[TargetCores]:
        return self._res.cores

    @classmethod
    def start(cls, draft_model: Decoder, num_slots: int, max_model_len: int, config: SSDConfig,
              draft_version: int = 0) -> "WorkerClient":
        res = _Resources()
        try:
            return cls._start(res, draft_model, num_slots, max_model_len, config, draft_version)
        except BaseException as err:
            res.release()
            if isinstance(err, (OSError, EOFError, MalformedMessage, TimeoutError)):
                raise WorkerFailure(f"draft worker failed to start: {err}") from err
            raise

    @classmethod
    def _start(cls, res, draft_model, num_slots, max_model_len, config, draft_version) -> "WorkerClient":
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        res.directory = tempfile.mkdtemp(prefix="rollout-ssd-", dir=base)
        vocab = draft_model.cfg.vocab_size
        sizes = Buffers.sizes(num_slots, max_model_len, config.k, vocab)
        bufs = Buffers.open(res.directory, sizes)
        weights_path = os.path.join(res.directory, "weights")
        manifest = _write_weights(draft_model, weights_path)
        socket_path = os.path.join(res.directory, "sock")
        res.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        res.listener.bind(socket_path)
        res.listener.listen(1)

        res.cores, core = split_for_worker(config.pin_cores)
        args = {
            "directory": res.directory, "socket_path": socket_path, "sizes": list(sizes),
            "weights_path": weights_path, "manifest": manifest,
            "model_config": dataclasses.asdict(draft_model.cfg), "inv_freq": draft_model.inv_freq.tolist(),
            "rope_scaling": float(draft_model.rope_scaling), "dtype": str(draft_model.dtype).replace("torch.", ""),
            "int4_group": getattr(draft_model, "int4_group", None),  # an int4 draft (models/quant.py)
            "num_slots": num_slots, "max_model_len": max_model_len, "k": config.k,
            "max_branches": config.max_branches, "C": config.saguaro_c, "c_min": config.c_min, "core": core,
            "draft_version": int(draft_version),
        }
        # A fresh interpreter running this module: unlike multiprocessing's spawn it never re-imports
        # the caller's __main__ (scripts without a main guard and notebooks work), and it receives
        # only a JSON file of plain values.
        args_path = os.path.join(res.directory, "args.json")
        with open(args_path, "w") as f:
            json.dump(args, f)
        spare = _take_spare()
        if spare is not None:  # started ahead (`prestart`): it has imported meanwhile
            try:
                spare.hand(args_path)
                res.proc = spare
            except OSError:
                spare.kill()
        if res.proc is None:
            res.proc = _WorkerProcess(args_path)

        deadline = time.monotonic() + config.startup_timeout
        res.listener.settimeout(0.5)
        while res.sock is None:
            try:
                res.sock, _ = res.listener.accept()
            except socket.timeout:
                if not res.proc.is_alive():
                    raise WorkerFailure(f"draft worker exited during start-up (code {res.proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise WorkerFailure("draft worker did not connect in time") from None
        res.listener.close()
        res.listener = None
        client = cls(res, bufs, config.worker_timeout)
        ready = client._receive(Ready, config.startup_timeout, expect_seq=0)
        log.info("SSD draft worker %d ready (core %s)", ready.pid, core)
        return client

    # -------------------------------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        self._check()
        try:
            ints, floats = msg.encode()
            if floats is not None and floats.numel():
                raise ValueError("target -> worker messages carry no floats")
            if len(ints) > self._bufs.to_ints.numel():
                raise ValueError(f"{type(msg).__name__} needs {len(ints)} ints, the buffer holds "
                                 f"{self._bufs.to_ints.numel()}")
            if self._offset + len(ints) > self._bufs.to_ints.numel():
                self._barrier()
            self._bufs.to_ints[self._offset: self._offset + len(ints)] = torch.tensor(ints, dtype=torch.int64)
            self._seq += 1
            send_header(self._res.sock, msg.KIND, self._seq, self._offset, len(ints), 0)
            self._offset += len(ints)
        except (OSError, EOFError) as err:
            raise self._die(f"send failed: {err}") from err

    def request(self, msg: Message) -> Message:
        reply_type = REPLIES.get(type(msg))
        if reply_type is None:
            raise ValueError(f"{type(msg).__name__} gets no reply")
        self.send(msg)
        reply = self._receive(reply_type, self._timeout, expect_seq=self._seq)
        self._offset = 0
        return reply

    def update_weights(self, new: dict[str, torch.Tensor], old: dict[str, torch.Tensor],
                       draft_version: int) -> None:
        """Bring the worker's draft to `new` (name -> tensor; `old[name]`, where given, is what the worker
        holds now, so an exact delta is sent; else the full tensor). Blocks until the worker applied it."""
        self._check()
        transfer = self._transfer + 1
        path = update_path(self._res.directory, transfer)
        try:
            msg = write_update(self._res.directory, transfer, draft_version, new, old)
            reply = self.request(msg)
        except OSError as err:
            raise self._die(f"writing the draft weight update failed: {err}") from err
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
        if not reply.accepted or reply.transfer != transfer:
            raise self._die(f"the worker rejected draft weight transfer {transfer} (see its stderr)")
        self._transfer = transfer
        self.weight_bytes += msg.layout()[1]

    def digest(self) -> DraftWeightsReply:
        """The worker's own digest of every draft weight it holds (draft_server.weights_digest)."""
        return self.request(DraftDigest())

    def _barrier(self) -> None:
        self._seq += 1
        send_header(self._res.sock, Barrier.KIND, self._seq, 0, 0, 0)
        self._receive(REPLIES[Barrier], self._timeout, expect_seq=self._seq)
        self._offset = 0

    def _receive(self, expected: type, timeout: float, expect_seq: int) -> Message:
        sock = self._res.sock
        try:
            sock.settimeout(timeout)
            kind, seq, offset, n_ints, n_floats = read_header(sock)
            if kind != expected.KIND or seq != expect_seq or offset != 0:
                raise MalformedMessage(f"expected {expected.__name__} #{expect_seq}, got kind {kind} #{seq}")
            if not 0 <= n_ints <= self._bufs.from_ints.numel() or not 0 <= n_floats <= self._bufs.from_floats.numel():
                raise MalformedMessage("reply payload outside the shared buffer")
            ints = self._bufs.from_ints[:n_ints].tolist()
            floats = self._bufs.from_floats[:n_floats].clone() if n_floats else None
            return expected.decode(ints, floats)
        except socket.timeout as err:
            raise self._die(f"no reply within {timeout:.1f} s") from err
        except (OSError, EOFError, MalformedMessage) as err:
            raise self._die(f"{type(err).__name__}: {err}") from err

    def _check(self) -> None:
        if self._dead is not None:
            raise WorkerFailure(f"draft worker is dead ({self._dead})")
        proc = self._res.proc
        if proc is None or not proc.is_alive():
            raise self._die(f"process exited (code {None if proc is None else proc.exitcode})")

    def _die(self, reason: str) -> WorkerFailure:
        self._dead = reason
        self._res.graceful = False
        return WorkerFailure(f"draft worker: {reason}")

    def close(self) -> None:
        self._finalizer()  # runs _Resources.release once
