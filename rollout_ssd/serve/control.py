"""vLLM's dev-mode control endpoints an RL trainer calls (names and JSON shapes as vLLM's), and weight
updates: from a checkpoint directory on disk, or by joining a learner's torch.distributed (gloo) group
and serving its transfers (rollout_ssd.weight_sync). Updates apply between rounds (engine.update_weights,
engine.attach_receiver); a bad one is HTTP 400 and the server keeps serving its version.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Optional

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from rollout_ssd.serve.limits import json_object
from rollout_ssd.serve.protocol import BadRequest


class DiskUpdate(BaseModel):
    """POST /update_weights_from_disk (for the OpenAPI schema; the handler checks the body itself)."""
    model_config = ConfigDict(extra="forbid")
    model_path: str
    weight_version: Optional[int] = None


class TransferInit(BaseModel):
    """POST /init_weight_transfer_engine: init_info holds init_method or master_address + master_port,
    rank_offset, world_size, backend ("gloo") and timeout (seconds)."""
    model_config = ConfigDict(extra="forbid")
    init_info: dict[str, Any]


BODIES = {"/update_weights_from_disk": DiskUpdate, "/init_weight_transfer_engine": TransferInit}
MAX_JOIN_TIMEOUT_S = 3600.0


def control_routes(app: FastAPI, server) -> None:
    """vLLM's dev-mode control endpoints an RL trainer calls (names and JSON shapes), and weight updates."""
    engine = server.engine

    @app.post("/pause")
    async def pause():
        engine.pause()
        return {"paused": True}

    @app.post("/resume")
    async def resume():
        engine.resume()
        return {"paused": False}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.scheduler.paused}

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": engine.weight_version}

    @app.get("/get_world_size")
    async def world_size():
        return {"world_size": 1}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return {"success": True}  # no prefix cache: KV never outlives its sequence

    @app.get("/server_info")
    async def server_info():
        cfg = {"model_config": {"model": server.model_name, "dtype": str(engine.target.model.dtype),
                                "max_model_len": engine.max_model_len},
               "weight_transfer_config": {"backend": "rollout_ssd"}, "method": engine.spec.method}
        return {"vllm_config": cfg, "limits": server.limits.as_dict(), "admission": _admission(engine)}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(raw: Request):
        data = await json_object(raw)
        unknown = sorted(set(data) - {"model_path", "weight_version"})
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r}", unknown[0])
        path = data.get("model_path")
        if not isinstance(path, str) or "\0" in path or not Path(path).is_dir():
            raise BadRequest(f"model_path must be a checkpoint directory, got {path!r}", "model_path")
        version = data.get("weight_version", engine.weight_version + 1)
        if not isinstance(version, int) or isinstance(version, bool):
            raise BadRequest(f"weight_version must be an integer, got {version!r}", "weight_version")
        from rollout_ssd.models.loader import load_safetensors_dir

        try:
            state = await asyncio.to_thread(load_safetensors_dir, Path(path))
        except Exception as err:  # unreadable files in the directory the request named
            raise BadRequest(f"could not read the checkpoint: {err}", "model_path") from None
        try:
            await asyncio.to_thread(engine.update_weights, state.items(), version)
        except ValueError as err:
            raise BadRequest(str(err), "model_path") from None
        return {"success": True, "weight_version": version}

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer(raw: Request):
        data = await json_object(raw)
        info = data.get("init_info")
        if not isinstance(info, dict):
            raise BadRequest("init_info must be an object", "init_info")
        if server.receiver_attached:
            raise BadRequest("a weight-transfer group is already attached", "init_info")
        group = _init_info(info)
        server.receiver_attached = True  # claimed before the join, so a second call cannot race it
        try:
            await asyncio.to_thread(_join_weight_sync, engine, *group)
        except BaseException as err:
            server.receiver_attached = False
            if isinstance(err, (RuntimeError, ValueError, OSError)):  # the group could not be joined
                raise BadRequest(f"could not join the weight-transfer group: {err}", "init_info") from None
            raise
        return {"success": True}


def _admission(engine) -> dict:
    return {"policy": engine.config.admission, "reserved_slots": engine.scheduler.waiting.reserved,
            "kv_slots": engine.runner.cache.num_slots, "max_round_rows": engine.config.max_round_rows}


def _init_info(info: dict) -> tuple[str, int, int, float]:
    """(init_method, rank, world size, timeout) of init_info, every field checked (400 naming it)."""
    allowed = {"init_method", "master_address", "master_port", "rank_offset", "world_size", "backend", "timeout"}
    unknown = sorted(set(info) - allowed)
    if unknown:
        raise BadRequest(f"unknown field 'init_info.{unknown[0]}'", f"init_info.{unknown[0]}")
    backend = info.get("backend", "gloo")
    if backend != "gloo":
        raise BadRequest(f"init_info.backend {backend!r} is not available on this server (gloo)", "init_info.backend")
    init_method = info.get("init_method")
    if init_method is None:
        address, port = info.get("master_address"), info.get("master_port")
        if not isinstance(address, str) or not address or "\0" in address:
            raise BadRequest("init_info needs init_method or master_address (a host name)", "init_info.master_address")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise BadRequest("init_info.master_port must be an integer in [1, 65535]", "init_info.master_port")
        init_method = f"tcp://{address}:{port}"
    if not isinstance(init_method, str) or not init_method.startswith(("tcp://", "file://")) or "\0" in init_method:
        raise BadRequest("init_info.init_method must be a tcp:// or file:// URL", "init_info.init_method")
    rank, world = info.get("rank_offset", 1), info.get("world_size", 2)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, world)) or not 0 < rank < world:
        raise BadRequest("init_info.rank_offset must be an integer in [1, world_size)", "init_info.rank_offset")
    timeout = info.get("timeout", 60.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_JOIN_TIMEOUT_S:
        raise BadRequest(f"init_info.timeout must be seconds in (0, {MAX_JOIN_TIMEOUT_S:g}]", "init_info.timeout")
    return init_method, rank, world, float(timeout)


def _join_weight_sync(engine, init_method: str, rank: int, world: int, timeout: float) -> None:
    """Join a learner's torch.distributed (gloo) group as rank `rank_offset` and serve its transfers
    (rollout_ssd.weight_sync: manifests, checksums, full and delta updates, versions)."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from rollout_ssd.weight_sync import DistributedTransport, WeightReceiver

    if dist.is_initialized():
        raise BadRequest("this process already belongs to a torch.distributed group", "init_info")
    if "//127." in init_method or "//localhost" in init_method or init_method.startswith("file://"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    engine.attach_receiver(WeightReceiver(DistributedTransport(src=0, timeout=timeout)))
