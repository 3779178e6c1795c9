"""Shared fixtures. Tests run on CPU with one intra-op thread: deterministic and robust on a busy
2-core machine (oversubscribed OpenMP threads slow small matmuls by several times)."""

import os

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_f32():
    """SmolLM2-135M-Instruct (the embedded default) in float32, loaded once per session."""
    from rollout_ssd.models.loader import load_pretrained

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return load_pretrained("smollm2-135m-instruct", dtype="float32")
