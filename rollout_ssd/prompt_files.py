"""Prompt files: the prompts of an offline job (datagen.py) from a .jsonl/.json file, a .parquet file or a
`datasets` directory saved with `save_to_disk`, checked one by one (non-empty text, or a non-empty list of
integer token ids), every problem a ValueError naming the file, the record and the column.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rollout_ssd.params import Prompt


def load_prompts(path: str, column: str, split: Optional[str] = None) -> list[Prompt]:
    """Prompts from a .jsonl/.json file, a .parquet file or a `save_to_disk` dataset directory.
    Each value must be non-empty text or a non-empty list of integer token ids."""
    source = Path(path)
    if not source.exists():
        raise ValueError(f"input {path!r} does not exist")
    if source.is_dir():
        values = _read_dataset_dir(source, column, split)
    elif source.suffix in (".jsonl", ".json"):
        values = _read_json_lines(source, column)
    elif source.suffix == ".parquet":
        values = _read_parquet(source, column)
    else:
        raise ValueError(f"input {path!r}: unknown format (expected .jsonl, .json, .parquet or a dataset directory "
                         f"saved with datasets' save_to_disk)")
    if not values:
        raise ValueError(f"input {path!r} holds no prompts")
    return [_check_prompt(v, i, column) for i, v in enumerate(values)]


def _read_json_lines(path: Path, column: str) -> list:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"input {str(path)!r} is unreadable: {err}") from err
    try:
        if text.lstrip().startswith("["):
            records = json.loads(text)
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise ValueError(f"input {str(path)!r} is not valid JSON lines: {err}") from err
    values = []
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"input {str(path)!r}: record {i} is not a JSON object")
        if column not in record:
            raise ValueError(f"input {str(path)!r}: record {i} has no column {column!r} (it has {sorted(record)})")
        values.append(record[column])
    return values


def _read_parquet(path: Path, column: str) -> list:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        if column not in names:
            raise ValueError(f"input {str(path)!r} has no column {column!r} (it has {names})")
        return pq.read_table(path, columns=[column]).column(column).to_pylist()
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"input {str(path)!r} is unreadable as parquet: {err}") from err


def _read_dataset_dir(path: Path, column: str, split: Optional[str]) -> list:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises FileNotFoundError, ValueError, arrow errors ...
        raise ValueError(f"input {str(path)!r} is not a dataset directory saved with save_to_disk: {err}") from err
    if isinstance(ds, datasets.DatasetDict):
        if split is None and len(ds) == 1:
            split = next(iter(ds))
        if split not in ds:
            raise ValueError(f"input {str(path)!r} holds splits {sorted(ds)}: choose one with split (--split)")
        ds = ds[split]
    if column not in ds.column_names:
        raise ValueError(f"input {str(path)!r} has no column {column!r} (it has {ds.column_names})")
    return list(ds[column])


def _check_prompt(value, index: int, column: str) -> Prompt:
    if isinstance(value, str):
        if not value:
            raise ValueError(f"prompt {index} (column {column!r}) is empty")
        return value
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"prompt {index} (column {column!r}) is empty")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in value):
            raise ValueError(f"prompt {index} (column {column!r}) must be text or a list of integer token ids")
        return list(value)
    raise ValueError(f"prompt {index} (column {column!r}) must be text or a list of integer token ids, "
                     f"got {type(value).__name__}")
