"""vLLM's dev-mode control endpoints an RL trainer calls (names and JSON shapes as vLLM's), and weight
updates: from a checkpoint directory on disk, or by joining a learner's torch.distributed (gloo) group
and serving its transfers (rollout_ssd.weight_sync). Updates apply between rounds (engine.update_weights,
engine.attach_receiver); a bad one is HTTP 400 and the server keeps serving its version.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import FastAPI, Request

from rollout_ssd.serve.protocol import BadRequest, json_object


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
        return {"vllm_config": cfg}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(raw: Request):
        data = await json_object(raw)
        unknown = sorted(set(data) - {"model_path", "weight_version"})
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r}", unknown[0])
        path = data.get("model_path")
        if not isinstance(path, str) or not Path(path).is_dir():
            raise BadRequest(f"model_path must be a checkpoint directory, got {path!r}", "model_path")
        version = data.get("weight_version", engine.weight_version + 1)
        if not isinstance(version, int) or isinstance(version, bool):
            raise BadRequest(f"weight_version must be an integer, got {version!r}", "weight_version")
        from rollout_ssd.models.loader import load_safetensors_dir

        try:
            state = await asyncio.to_thread(load_safetensors_dir, Path(path))
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
        server.receiver_attached = True  # claimed before the join, so a second call cannot race it
        try:
            await asyncio.to_thread(_join_weight_sync, engine, info)
        except BaseException:
            server.receiver_attached = False
            raise
        return {"success": True}


def _join_weight_sync(engine, info: dict) -> None:
    """Join a learner's torch.distributed (gloo) group as rank `rank_offset` and serve its transfers
    (rollout_ssd.weight_sync: manifests, checksums, full and delta updates, versions)."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from rollout_ssd.weight_sync import DistributedTransport, WeightReceiver

    allowed = {"init_method", "master_address", "master_port", "rank_offset", "world_size", "backend", "timeout"}
    unknown = sorted(set(info) - allowed)
    if unknown:
        raise BadRequest(f"unknown field 'init_info.{unknown[0]}'", f"init_info.{unknown[0]}")
    backend = info.get("backend", "gloo")
    if backend != "gloo":
        raise BadRequest(f"init_info.backend {backend!r} is not available on this server (gloo)", "init_info.backend")
    init_method = info.get("init_method") or f"tcp://{info.get('master_address')}:{info.get('master_port')}"
    rank, world = info.get("rank_offset", 1), info.get("world_size", 2)
    timeout = float(info.get("timeout", 60.0))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, world)) or not 0 < rank < world:
        raise BadRequest("init_info.rank_offset must be an integer in [1, world_size)", "init_info.rank_offset")
    if dist.is_initialized():
        raise BadRequest("this process already belongs to a torch.distributed group", "init_info")
    if "//127." in init_method or "//localhost" in init_method or init_method.startswith("file://"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    engine.attach_receiver(WeightReceiver(DistributedTransport(src=0, timeout=timeout)))
