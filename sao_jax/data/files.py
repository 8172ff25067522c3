"""File-backed prompt sets: JSONL, Parquet, and Hugging Face `datasets` save_to_disk folders.

Rows are read with random access (grain `RandomAccessDataSource`): a JSONL file is indexed
once by the byte offset of each line (8 bytes a row stay in memory, a row is parsed when
it is asked for); Parquet files and `save_to_disk` folders (Arrow IPC stream files, read
with pyarrow, no `datasets` import) are memory-mapped Arrow tables holding only the mapped
columns. Every row is checked when the file is opened, so a bad row stops the run before
anything compiles, with one line naming the file, the line (or row) and the field.

A `FieldMap` turns a row into a Prompt:
  prompt     text field of the question (or `messages`: a list of {"role", "content"}
             chat messages, which needs a chat template),
  answer     reference answer field (`answer_regex` keeps group 1 of its last match:
             GSM8K's "...#### 72" -> "72" with r"####\\s*(.+)"),
  id         field of a stable row id ("" = file name and row number),
  meta       fields copied into Prompt.meta,
  prompt_format  str.format template of the prompt text: "{prompt}" or e.g.
             "{prompt}\\nPut the final answer in \\\\boxed{{}}." (other fields by name).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import string
from collections.abc import Mapping
from typing import Any

import numpy as np

from sao_jax.envs.base import Prompt

FORMATS = ("jsonl", "parquet", "hf_disk")


class DataError(ValueError):
    """A dataset file, row or field is missing or malformed; the message names it."""


class MissingField(DataError):
    """A row lacks a field the FieldMap needs; `field` is the row field, `setting` the
    config field that asks for it (FieldMap.required)."""

    def __init__(self, message: str, field: str, setting: str):
        super().__init__(message)
        self.field, self.setting = field, setting


@dataclasses.dataclass(frozen=True)
class FieldMap:
    prompt: str = "prompt"
    messages: str = ""
    answer: str = "answer"
    id: str = ""
    meta: tuple[str, ...] = ()
    answer_regex: str = ""
    prompt_format: str = "{prompt}"

    def __post_init__(self):
        if bool(self.prompt) == bool(self.messages):
            raise DataError("config field data.fields: set exactly one of prompt and messages")
        if self.answer_regex:
            try:
                re.compile(self.answer_regex)
            except re.error as e:
                raise DataError(f"config field data.answer_regex: not a regex: {e}") from None

    @property
    def required(self) -> dict[str, str]:
        """Every field a row must have (the mapped ones and those prompt_format names),
        each with the config field that asks for it, in that order."""
        try:
            named = [f for _, f, _, _ in string.Formatter().parse(self.prompt_format) if f]
        except ValueError as e:
            raise DataError(f"config field data.prompt_format: {e}") from None
        named = [re.split(r"[.\[]", f, maxsplit=1)[0] for f in named]  # "{a.b}" needs a
        named = [f for f in named if f != "prompt"]  # {prompt} is the prompt field's text
        text = ("data.fields.prompt", self.prompt) if self.prompt else None
        names = [
            text or ("data.fields.messages", self.messages),
            ("data.fields.answer", self.answer),
            ("data.fields.id", self.id),
            *(("data.fields.meta", m) for m in self.meta),
            *(("data.prompt_format", n) for n in named),
        ]
        out: dict[str, str] = {}
        for setting, name in names:
            if name:
                out.setdefault(name, setting)
        return out


def detect_format(path: str | pathlib.Path) -> str:
    """'jsonl' (.jsonl, .json), 'parquet' (.parquet, or a folder of them) or 'hf_disk' (a
    folder with state.json / dataset_info.json, as `Dataset.save_to_disk` writes)."""
    p = pathlib.Path(path)
    if p.is_dir():
        if (p / "dataset_dict.json").is_file():
            splits = sorted(d.name for d in p.iterdir() if d.is_dir())
            raise DataError(
                f"{p}: a DatasetDict folder; name one split folder, one of "
                f"{[str(p / s) for s in splits]}"
            )
        if (p / "state.json").is_file() or (p / "dataset_info.json").is_file():
            return "hf_disk"
        if any(p.glob("*.parquet")):
            return "parquet"
        raise DataError(f"{p}: neither a save_to_disk folder nor a folder of *.parquet files")
    if not p.is_file():
        raise DataError(f"dataset file {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    raise DataError(f"{p}: unknown dataset format {suffix!r} (.jsonl, .parquet, or a folder)")


class JsonlRows:
    """Random access to the JSON objects of a JSONL file (blank lines are skipped)."""

    def __init__(self, path: str | pathlib.Path, required: Mapping[str, str]):
        self.path = pathlib.Path(path)
        offsets, lines = [], []
        try:
            with open(self.path, "rb") as f:
                pos = 0
                for lineno, raw in enumerate(f, start=1):
                    if raw.strip():
                        self._check(raw, lineno, required)
                        offsets.append(pos)
                        lines.append(lineno)
                    pos += len(raw)
        except OSError as e:
            raise DataError(f"{self.path}: cannot read: {e}") from None
        if not offsets:
            raise DataError(f"{self.path}: no rows")
        self._offsets = np.asarray(offsets, np.int64)
        self.lines = np.asarray(lines, np.int64)

    def _check(self, raw: bytes, lineno: int, required: Mapping[str, str]) -> None:
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{self.path}:{lineno}: not valid JSON: {e}") from None
        if not isinstance(row, dict):
            raise DataError(f"{self.path}:{lineno}: a row must be a JSON object")
        for field, setting in required.items():
            if row.get(field) is None:
                raise MissingField(
                    f"{self.path}:{lineno}: missing field {field!r}; the row has {list(row)}",
                    field,
                    setting,
                )

    def where(self, i: int) -> str:
        return f"{self.path}:{int(self.lines[i])}"

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i: int) -> dict[str, Any]:
        with open(self.path, "rb") as f:
            f.seek(int(self._offsets[i]))
            return json.loads(f.readline())


class ArrowRows:
    """Random access to the rows of an Arrow table (Parquet, save_to_disk folders)."""

    def __init__(self, path: str | pathlib.Path, fmt: str, required: Mapping[str, str]):
        import pyarrow as pa
        import pyarrow.compute as pc

        self.path = pathlib.Path(path)
        table = _read_parquet(self.path) if fmt == "parquet" else _read_hf_disk(self.path)
        missing = [f for f in required if f not in table.column_names]
        if missing:
            raise MissingField(
                f"{self.path}: missing field {missing[0]!r}; columns: {table.column_names}",
                missing[0],
                required[missing[0]],
            )
        table = table.select(list(required))
        for field, setting in required.items():
            nulls = pc.is_null(table[field])
            if pc.any(nulls).as_py():
                row = int(pc.index(nulls, pa.scalar(True)).as_py())
                raise MissingField(
                    f"{self.path}: row {row}: missing field {field!r} (null); columns: "
                    f"{table.column_names}",
                    field,
                    setting,
                )
        if table.num_rows == 0:
            raise DataError(f"{self.path}: no rows")
        self._table = table

    def where(self, i: int) -> str:
        return f"{self.path}: row {i}"

    def __len__(self) -> int:
        return self._table.num_rows

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._table.slice(int(i), 1).to_pylist()[0]


def _read_parquet(path: pathlib.Path):
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path, memory_map=True)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError
        raise DataError(f"{path}: cannot read as Parquet: {e}") from None


def _read_hf_disk(path: pathlib.Path):
    """The Arrow IPC stream files `Dataset.save_to_disk` writes (listed in state.json)."""
    import pyarrow as pa

    files = sorted(path.glob("data-*.arrow"))
    state = path / "state.json"
    if state.is_file():
        try:
            listed = json.loads(state.read_text())["_data_files"]
            files = [path / f["filename"] for f in listed]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{state}: not a save_to_disk state file: {e}") from None
    if not files:
        raise DataError(f"{path}: no data-*.arrow files")
    tables = []
    for f in files:
        try:
            with pa.memory_map(str(f)) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        except Exception as e:  # ArrowInvalid, OSError
            raise DataError(f"{f}: cannot read as an Arrow stream: {e}") from None
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def open_rows(path: str, fmt: str, fields: FieldMap):
    """Rows of a dataset, checked for `fields` (DataError naming the file, row, field)."""
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise DataError(f"config field data.format: {fmt!r} is not one of auto, {FORMATS}")
    if not pathlib.Path(path).exists():
        raise DataError(f"dataset file {path!r} does not exist")
    if fmt == "jsonl":
        return JsonlRows(path, fields.required)
    return ArrowRows(path, fmt, fields.required)


def _messages(value: Any, where: str, field: str) -> tuple[dict[str, Any], ...]:
    ok = isinstance(value, list) and value
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
    )
    if not ok:
        raise DataError(f"{where}: field {field!r} is not a list of {{role, content}} messages")
    return tuple(dict(m) for m in value)


class PromptRows:
    """grain RandomAccessDataSource of Prompt over `rows[indices]` (all rows by default)."""

    def __init__(self, rows, fields: FieldMap, name: str, indices: np.ndarray | None = None):
        self.rows, self.fields, self.name = rows, fields, name
        self.indices = np.arange(len(rows)) if indices is None else np.asarray(indices)
        self._regex = re.compile(fields.answer_regex) if fields.answer_regex else None
        if len(self.indices):
            self[0]  # a bad prompt_format or answer_regex fails now, naming the row

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> Prompt:
        i = int(self.indices[k])
        row, f = self.rows[i], self.fields
        where = self.rows.where(i)
        answer = self._answer(row[f.answer], where)
        meta = {m: row[m] for m in f.meta}
        if f.messages:
            messages = _messages(row[f.messages], where, f.messages)
            meta["messages"] = messages
            text = "\n".join(str(m["content"]) for m in messages if m["role"] != "system")
        else:
            text = self._format(row, where)
        uid = f"{self.name}:{row[f.id]}" if f.id else f"{self.name}:{i}"
        return Prompt(uid=uid, text=text, answer=answer, meta=meta)

    def _answer(self, value: Any, where: str) -> Any:
        if self._regex is None:
            return value
        matches = list(self._regex.finditer(str(value)))
        if not matches:
            raise DataError(
                f"{where}: field {self.fields.answer!r} does not match data.answer_regex "
                f"{self.fields.answer_regex!r}"
            )
        m = matches[-1]
        return (m.group(1) if m.groups() else m.group(0)).strip()

    def _format(self, row: dict[str, Any], where: str) -> str:
        prompt = str(row[self.fields.prompt])
        try:
            return self.fields.prompt_format.format_map({**row, "prompt": prompt})
        except (KeyError, IndexError, ValueError) as e:
            raise DataError(
                f"{where}: config field data.prompt_format "
                f"{self.fields.prompt_format!r} cannot be filled: {type(e).__name__} {e}"
            ) from None
