"""The GGUF loader's tensor index (models/gguf_loader.py): kept after the first load, reused without
parsing the file again, and rebuilt when it is stale or unsound. Its byte ranges must be exactly the
reader's tensors (the weights against transformers are tests/test_model.py's)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from rollout_ssd.models import gguf_loader  # noqa: E402
from rollout_ssd.models.disk_cache import file_key  # noqa: E402
from rollout_ssd.models.registry import resolve_builtin  # noqa: E402


@pytest.fixture(scope="module")
def parsed():
    """The built-in GGUF's path and what the reader makes of it, parsed once (a parse takes seconds)."""
    path = resolve_builtin("smollm2-135m-instruct")
    return path, gguf_loader._read_index(path)


@pytest.fixture
def gguf_copy(parsed, tmp_path, monkeypatch):
    """The built-in GGUF's path, a private cache, and a list of the parses `gguf_index` asks for (each
    answered with the module's one parse: a parse of the same file)."""
    monkeypatch.setenv("ROLLOUT_SSD_CACHE", str(tmp_path / "cache"))
    path, fields = parsed
    parses = []
    monkeypatch.setattr(gguf_loader, "_read_index", lambda p: parses.append(p) or json.loads(json.dumps(fields)))
    return path, parses


def _index_file(tmp_path, path):
    return tmp_path / "cache" / "gguf" / f"{file_key(path)}.json"


def test_index_is_kept_and_reused_without_parsing_again(gguf_copy, tmp_path):
    path, parses = gguf_copy
    first = gguf_loader.gguf_index(path)
    assert len(parses) == 1 and _index_file(tmp_path, path).is_file()
    again = gguf_loader.gguf_index(path)
    assert len(parses) == 1  # read from the cache
    assert again == json.loads(json.dumps(first))
    assert again["model_type"] == "llama" and again["config"]["num_hidden_layers"] == 30


def test_index_byte_ranges_are_the_readers_tensors(gguf_copy):
    path, _ = gguf_copy
    index = gguf_loader.gguf_index(path)
    reader = gguf.GGUFReader(str(path))
    data = np.memmap(path, dtype=np.uint8, mode="r")
    assert [e["name"] for e in index["tensors"]] == [t.name for t in reader.tensors]
    for entry, tensor in zip(index["tensors"], reader.tensors):
        stored = data[entry["offset"]: entry["offset"] + entry["nbytes"]].view(entry["dtype"]).reshape(entry["shape"])
        assert stored.dtype == tensor.data.dtype and stored.shape == tensor.data.shape, entry["name"]
        assert np.array_equal(stored, tensor.data), entry["name"]
        assert entry["type"] == int(tensor.tensor_type)


def test_a_changed_file_gets_a_new_index(gguf_copy, tmp_path):
    source, parses = gguf_copy
    path = tmp_path / "model.gguf"
    shutil.copyfile(source, path)
    gguf_loader.gguf_index(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    gguf_loader.gguf_index(path)
    assert len(parses) == 2
    assert json.loads(_index_file(tmp_path, path).read_text())["mtime_ns"] == st.st_mtime_ns + 10**9


@pytest.mark.parametrize("damage", ["not json", "not an object", "other format", "past the end", "wrong size",
                                    "bad type", "stale stamp", "float offset", "a name twice"])
def test_an_unsound_index_is_rebuilt_not_used(gguf_copy, tmp_path, caplog, damage):
    path, parses = gguf_copy
    good = gguf_loader.gguf_index(path)
    index = json.loads(json.dumps(good))
    entry = index["tensors"][3]
    if damage == "other format":
        index["format"] = gguf_loader.INDEX_FORMAT + 1
    elif damage == "past the end":
        entry["offset"] = index["size"] - entry["nbytes"] + 1
    elif damage == "wrong size":
        entry["shape"][0] += 1
    elif damage == "bad type":
        entry["type"] = 10**6
    elif damage == "stale stamp":
        index["size"] += 1
    elif damage == "float offset":
        entry["offset"] = float(entry["offset"])
    elif damage == "a name twice":
        index["tensors"][4]["name"] = entry["name"]
    text = {"not json": "{", "not an object": "[]"}.get(damage, json.dumps(index))
    _index_file(tmp_path, path).write_text(text)
    with caplog.at_level(logging.WARNING, logger=gguf_loader.__name__):
        rebuilt = gguf_loader.gguf_index(path)
    assert len(parses) == 2, damage
    assert "rebuilding the GGUF index" in caplog.text
    assert rebuilt == json.loads(json.dumps(good))
    assert json.loads(_index_file(tmp_path, path).read_text()) == rebuilt  # the sound one is kept again


def test_a_read_only_cache_still_loads(gguf_copy, tmp_path, monkeypatch, caplog):
    path, parses = gguf_copy
    (tmp_path / "cache").write_text("a file where the cache directory would be")
    with caplog.at_level(logging.WARNING, logger=gguf_loader.__name__):
        index = gguf_loader.gguf_index(path)
        gguf_loader.gguf_index(path)
    assert len(parses) == 2 and index["tensors"]
    assert "could not keep the GGUF index" in caplog.text


def test_a_failed_write_leaves_no_temporary_file(gguf_copy, tmp_path, monkeypatch):
    path, _ = gguf_copy

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_loader.os, "replace", refuse)
    assert gguf_loader.gguf_index(path)["tensors"]
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
