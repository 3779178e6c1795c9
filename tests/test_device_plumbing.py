"""Every tensor a forward needs is made on the model's device (issue 17, part A).

The model and its KV cache are placed on `meta`, a device without data, and the forwards run under a
dispatch mode that fails any op whose tensor arguments (0-dim CPU scalars excepted, as CUDA allows)
span two devices. Plain `meta` is not enough on its own: it accepts CPU indices in `F.embedding` and
`index_select`, which on a GPU are a device error or a hidden copy that a CUDA graph cannot capture.
Host syncs cannot run on `meta`, so sampling and verification are covered on the GPU check instead.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rollout_ssd.gpu.graphs import GraphedSteps
from rollout_ssd.models.loader import load_pretrained
from rollout_ssd.runner import ModelRunner
from tests.support.models import hf_config, randomize


class DeviceGuard(TorchDispatchMode):
    """Raise on any aten op mixing devices; `ops` counts the ops seen (so a test knows it ran)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        devices = {t.device for t in flat if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")}
        if len(devices) > 1 and func not in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            raise RuntimeError(f"{func} mixes devices {sorted(map(str, devices))}")
        self.ops += 1
        return func(*args, **kwargs)


def test_the_guard_catches_a_cpu_index_into_device_weights():
    weight = torch.zeros(8, 4, device="meta")
    with pytest.raises(RuntimeError, match="mixes devices"):
        with DeviceGuard():
            torch.nn.functional.embedding(torch.tensor([1, 2]), weight)
    with DeviceGuard():  # a host-to-device copy is how inputs get there: allowed
        torch.tensor([1, 2]).to("meta")


@pytest.fixture(scope="module", params=["llama-gqa-untied", "qwen3-qknorm-yarn"])
def meta_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("meta")
    model = AutoModelForCausalLM.from_config(hf_config(request.param))
    randomize(model, seed=0)
    model.save_pretrained(d)
    return load_pretrained(str(d), dtype="float32").model.to("meta")


def test_runner_forwards_make_every_input_on_the_model_device(meta_model):
    runner = ModelRunner(meta_model, num_slots=4, max_len=32)
    assert runner.cache.keys[0].device.type == "meta"
    guard = DeviceGuard()
    with guard:
        out = [runner.prefill([2, 0], [[1, 2, 3], [4, 5]]),  # ragged prefill
               runner.decode([2, 0], [3, 4]),  # rows out of slot order, unequal lengths
               runner.decode([0, 1, 2], [5, 6, 7]) if runner.prefill([1], [[9]]) is not None else None,
               runner.extend([0, 2], [[1, 2], [3]]),  # ragged multi-token (a verify)
               runner.extend([2], [[4, 5]], positions=torch.tensor([[9, 9]]),  # a tree step: positions + mask
                             mask=torch.ones(1, 2, 32, dtype=torch.bool), last_only=True),
               runner.extend([0], [[1]], head_only=True)]
    assert guard.ops > 100
    assert all(o.device.type == "meta" for o in out)


def test_static_steps_make_every_input_on_the_model_device(meta_model):
    runner = ModelRunner(meta_model, num_slots=4, max_len=32)
    runner.cache.lengths[:3] = [5, 2, 7]
    steps = GraphedSteps(meta_model, runner.cache, buckets=(4,))
    with DeviceGuard():
        out = steps.run([2, 0, 1], [[1, 2], [3, 4], [5, 6]])
    assert out.device.type == "meta" and out.shape[0] == 3
