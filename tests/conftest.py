"""Shared fixtures. Tests run on CPU with one intra-op thread: deterministic and robust on a busy
2-core machine (oversubscribed OpenMP threads slow small matmuls by several times).

Helpers (tiny checkpoints, transformers references, exact laws, the chi-square test) are plain
functions in tests/support/; fixtures shared by several test files live here. Tests marked `slow`
(the SmolLM2 model, worker and server processes, Ray, gloo) are left out by `make test-fast`.
"""

import os

import pytest
import torch

torch.set_num_threads(1)
# engines (and the servers and actors tests start) measure anew: one test's strategy-rule cache must
# not steer another's plans (tests/test_rule_cache.py names a directory of its own)
os.environ["ROLLOUT_SSD_RULE_CACHE"] = "0"
# compiled steps do not autotune their one-token GEMMs: each compile is shorter (a fresh CI machine compiles
# every shape anew); tests/test_gpu_graphs.py's frozen-steps test turns it on for the autotuned steps
os.environ["ROLLOUT_SSD_AUTOTUNE"] = "0"


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


@pytest.fixture(scope="session")
def hf_default():
    """transformers' own GGUF loading of SmolLM2 (float32, eval), the reference for default_model_f32.
    Shared: a test that changes it works on a copy."""
    from tests.support.hf_reference import hf_default_model

    return hf_default_model()
