"""A run's prompts from its config: a task's built-in generator or a dataset file.

    train, eval_prompts = run_prompts(config)   # grain.MapDataset (endless), list[Prompt]

`data.train` empty: the task's procedural prompts (sao_jax/data/prompts.py; difficulty
from `env.prompts`, held-out split by uid hash). Otherwise rows of `data.train`
(JSONL, Parquet or a save_to_disk folder; sao_jax/data/files.py) through `data.fields`;
held-out prompts from `data.eval`, or, when it is empty, a seeded split of data.train:
`env.eval_fraction` of its rows drawn with `data.split_seed` (the same rows for every run
seed). Training rows are shuffled with the run seed, reshuffled each epoch, endlessly;
evaluation takes the first `env.eval_size` held-out rows, in file order. The trainer
shards the training set by process (`distributed.process_shard`) and checkpoints the
iterator's position (`get_state` / `set_state`).
"""

from __future__ import annotations

import pathlib

import grain
import numpy as np

from sao_jax.data import files
from sao_jax.data.prompts import prompt_source
from sao_jax.envs.base import Prompt
from sao_jax.schema import ConfigDict, ConfigError


def field_map(data: ConfigDict) -> files.FieldMap:
    f = data.fields
    try:
        return files.FieldMap(
            prompt=f.prompt,
            messages=f.messages,
            answer=f.answer,
            id=f.id,
            meta=tuple(f.meta),
            answer_regex=data.answer_regex,
            prompt_format=data.prompt_format,
        )
    except files.DataError as e:
        raise ConfigError(str(e)) from None


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) row indices, each sorted: round(eval_fraction * n) rows (at least 1,
    at most n - 1) drawn without replacement by np.random.default_rng(seed)."""
    if n < 2:
        raise ConfigError(
            f"config field data.eval: the dataset has {n} row(s), too few to split; "
            "give a held-out file in data.eval"
        )
    n_eval = min(max(1, round(eval_fraction * n)), n - 1)
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


def _rows(path: str, data: ConfigDict, fields: files.FieldMap, field: str):
    try:
        return files.open_rows(path, data.format, fields)
    except files.MissingField as e:  # the setting that asks for the field, not the file
        raise ConfigError(f"config field {e.setting}: {e}") from None
    except files.DataError as e:
        raise ConfigError(f"config field data.{field}: {e}") from None


def _source(rows, fields, name, indices=None) -> files.PromptRows:
    try:
        return files.PromptRows(rows, fields, name, indices)
    except files.DataError as e:
        raise ConfigError(str(e)) from None


def file_prompts(
    config: ConfigDict, seed: int | None = None
) -> tuple[grain.MapDataset, list[Prompt]]:
    data, env = config.data, config.env
    fields = field_map(data)
    rows = _rows(data.train, data, fields, "train")
    name = pathlib.Path(data.train).stem or "data"
    if data.eval:
        train = _source(rows, fields, name)
        held = _source(_rows(data.eval, data, fields, "eval"), fields, pathlib.Path(data.eval).stem)
    else:
        train_idx, eval_idx = split_indices(len(rows), env.eval_fraction, data.split_seed)
        train = _source(rows, fields, name, train_idx)
        held = _source(rows, fields, name, eval_idx)
    eval_prompts = [held[i] for i in range(min(env.eval_size, len(held)))]
    ds = grain.MapDataset.source(train)
    if data.shuffle:
        ds = ds.shuffle(seed=config.seed if seed is None else seed)
    return ds.repeat(), eval_prompts


def run_prompts(
    config: ConfigDict, seed: int | None = None
) -> tuple[grain.MapDataset, list[Prompt]]:
    """(endless training MapDataset, held-out prompts) of a run; ConfigError names a bad
    field, file, row or task. `seed` (default config.seed) orders the training stream
    (value pretraining draws its own); the held-out prompts do not depend on it."""
    env = config.env
    seed = config.seed if seed is None else seed
    if config.data.train:
        return file_prompts(config, seed)
    if config.data.eval:
        raise ConfigError("config field data.eval: set only with data.train (a dataset)")
    kw = dict(eval_fraction=env.eval_fraction, **env.prompts)
    try:
        train = prompt_source(env.name, "train", seed=seed, **kw)
        held = list(prompt_source(env.name, "eval", size=env.eval_size, seed=config.seed, **kw))
    except ValueError as e:
        raise ConfigError(f"config field env.name: {e}") from None
    return train, held


def epoch_length(train: grain.MapDataset) -> int:
    """Distinct prompts of one epoch of `run_prompts`' endless training stream (one
    epoch, shuffled, repeated): `train[i]` for i below it is each of them once."""
    (epoch,) = train.parents
    return len(epoch)
