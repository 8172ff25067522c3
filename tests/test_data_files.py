"""Dataset prompt sources: JSONL, Parquet, save_to_disk folders, field maps, splits, errors."""

import itertools
import json

import grain
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import base
from sao_jax.config import validate
from sao_jax.data import files
from sao_jax.data.pipeline import run_prompts, split_indices
from sao_jax.schema import ConfigError
from tests.chat_support import gsm8k_rows, write_jsonl

GSM = r"####\s*(.+)$"


def _config(train, eval_path="", **data):
    c = base.get_config()
    c.env.name = "answer"
    c.init.kind = "random"
    c.sft.steps = 0
    c.data.train, c.data.eval = str(train), str(eval_path)
    c.data.fields.prompt = "question"
    c.data.answer_regex = GSM
    c.env.eval_size = 8
    for k, v in data.items():
        node, *rest = k.split("__")
        if rest:
            c.data[node][rest[0]] = v
        else:
            c.data[k] = v
    return validate(c)


def _take(ds, n):
    return list(itertools.islice(iter(ds.to_iter_dataset()), n))


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(64))


def test_jsonl_rows_map_to_prompts(jsonl):
    train, held = run_prompts(_config(jsonl, fields__id="id", fields__meta=("question",)))
    prompts = _take(train, 58)  # round(0.1 * 64) = 6 rows are held out
    assert len({p.uid for p in prompts}) == len(prompts)
    p = held[0]
    row = next(r for r in gsm8k_rows(64) if f"gsm8k:{r['id']}" == p.uid)
    assert p.text == row["question"] and p.answer == row["answer"].split("#### ")[1]
    assert p.meta == {"question": row["question"]}
    assert not {q.uid for q in held} & {q.uid for q in prompts}


def test_seeded_split_is_disjoint_deterministic_and_independent_of_the_run_seed(jsonl):
    tr, ev = split_indices(64, 0.25, seed=3)
    assert len(ev) == 16 and not set(tr) & set(ev) and sorted({*tr, *ev}) == list(range(64))
    assert [list(x) for x in split_indices(64, 0.25, 3)] == [list(tr), list(ev)]
    assert list(split_indices(64, 0.25, 4)[1]) != list(ev)
    a = _config(jsonl)
    b = _config(jsonl)
    b.unlock()
    b.seed = 1
    held_a, held_b = run_prompts(a)[1], run_prompts(b)[1]
    assert [p.uid for p in held_a] == [p.uid for p in held_b]  # same held-out rows
    assert [p.uid for p in _take(run_prompts(a)[0], 20)] != [
        p.uid for p in _take(run_prompts(b)[0], 20)
    ]  # shuffled by the run seed
    with pytest.raises(ConfigError, match="too few to split"):
        split_indices(1, 0.1, 0)


def test_separate_eval_file_and_epochs(tmp_path, jsonl):
    ev = write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(5, seed=1))
    train, held = run_prompts(_config(jsonl, ev))
    assert [p.uid for p in held] == [f"test:{i}" for i in range(5)]
    two_epochs = _take(train, 128)  # a separate eval file: all 64 rows train
    assert sorted(p.uid for p in two_epochs[:64]) == sorted(p.uid for p in two_epochs[64:])
    assert [p.uid for p in two_epochs[:64]] != [p.uid for p in two_epochs[64:]]  # reshuffled
    unshuffled = _take(run_prompts(_config(jsonl, ev, shuffle=False))[0], 3)
    assert [p.uid for p in unshuffled] == ["gsm8k:0", "gsm8k:1", "gsm8k:2"]


def test_iterator_position_checkpoints_and_restores(jsonl):
    train, _ = run_prompts(_config(jsonl))
    it = iter(train.to_iter_dataset())
    _ = [next(it) for _ in range(70)]  # into the second epoch
    state = it.get_state()
    expect = [next(it).uid for _ in range(10)]
    fresh = iter(run_prompts(_config(jsonl))[0].to_iter_dataset())
    fresh.set_state(state)
    assert [next(fresh).uid for _ in range(10)] == expect


def test_per_host_shards_are_disjoint_and_cover_an_epoch(jsonl):
    train, _ = run_prompts(_config(jsonl))
    shards = [list(itertools.islice(iter(train[p::2].to_iter_dataset()), 29)) for p in (0, 1)]
    uids = [{x.uid for x in s} for s in shards]
    assert not uids[0] & uids[1] and len(uids[0] | uids[1]) == 58  # 64 - 6 held out


def _table(rows):
    return pa.Table.from_pylist(rows)


def test_parquet_and_save_to_disk_folders_read_like_jsonl(tmp_path, jsonl):
    rows = gsm8k_rows(64)
    pq.write_table(_table(rows), tmp_path / "gsm8k.parquet")
    disk = tmp_path / "disk"
    disk.mkdir()
    arrow = str(disk / "data-00000-of-00001.arrow")
    with pa.OSFile(arrow, "wb") as sink, pa.ipc.new_stream(sink, _table(rows).schema) as writer:
        writer.write_table(_table(rows))
    (disk / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (disk / "dataset_info.json").write_text("{}")
    ref = run_prompts(_config(jsonl))
    for path in (tmp_path / "gsm8k.parquet", disk):
        got = run_prompts(_config(path))
        assert [(p.text, p.answer) for p in got[1]] == [(p.text, p.answer) for p in ref[1]]
        assert [p.answer for p in _take(got[0], 10)] == [p.answer for p in _take(ref[0], 10)]


def test_chat_messages_field(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(4)
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    c = _config(path, fields__prompt="", fields__messages="messages", answer_regex="")
    _, held = run_prompts(c)
    assert held[0].meta["messages"][0]["role"] == "user" and held[0].text.startswith("q")


def test_prompt_format_fills_fields(tmp_path, jsonl):
    c = _config(jsonl, prompt_format="Q: {prompt}\nid={id}. Put the answer in \\boxed{{}}.")
    p = run_prompts(c)[1][0]
    assert p.text.startswith("Q: what is") and p.text.endswith("Put the answer in \\boxed{}.")


OK = {"question": "a", "answer": "#### 1"}
BAD_ROWS = [
    (
        [OK, {"question": "b"}],
        {},
        r"^config field data.fields.answer: .*bad.jsonl:2: missing field 'answer'; the row has "
        r"\['question'\]$",
    ),
    (
        [OK],
        {"fields__prompt": "questoin"},
        r"^config field data.fields.prompt: .*bad.jsonl:1: missing field 'questoin'; the row "
        r"has \['question', 'answer'\]$",
    ),
    (["[1, 2]"], {}, r"bad.jsonl:1: a row must be a JSON object"),
    (["{oops"], {}, r"bad.jsonl:1: not valid JSON"),
    ([{"question": "a", "answer": "x"}] * 3, {}, r"bad.jsonl:\d: field 'answer' does not match"),
    ([OK] * 3, {"prompt_format": "{nope}"}, r"data.prompt_format: .*:1: missing field 'nope'"),
    ([OK] * 3, {"fields__id": "uid"}, r"^config field data.fields.id: .*missing field 'uid'"),
]


@pytest.mark.parametrize(("rows", "overrides", "error"), BAD_ROWS)
def test_bad_rows_are_named_by_file_line_and_field(tmp_path, rows, overrides, error):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=error) as e:
        run_prompts(_config(path, **overrides))
    assert "\n" not in str(e.value)


def test_bad_files_and_fields(tmp_path, jsonl):
    pq.write_table(_table([{"question": "a"}]), tmp_path / "x.parquet")
    want = r"config field data.fields.answer: .*x.parquet: missing field 'answer'; columns"
    with pytest.raises(ConfigError, match=want):
        run_prompts(_config(tmp_path / "x.parquet"))
    pq.write_table(_table([{"question": "a", "answer": None}] * 2), tmp_path / "n.parquet")
    with pytest.raises(ConfigError, match=r"n.parquet: row 0: missing field 'answer'"):
        run_prompts(_config(tmp_path / "n.parquet"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"data.train: .*unknown dataset format '.csv'"):
        run_prompts(_config(tmp_path / "x.csv"))
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text("{}")
    (tmp_path / "dd" / "train").mkdir()
    with pytest.raises(ConfigError, match="a DatasetDict folder; name one split folder"):
        run_prompts(_config(tmp_path / "dd"))
    with pytest.raises(ConfigError, match="data.fields: set exactly one of prompt"):
        _config(jsonl, fields__messages="m")
    with pytest.raises(ConfigError, match="data.format: one of"):
        _config(jsonl, format="csv")
    with pytest.raises(ConfigError, match="data.train: task 'answer' has no built-in prompts"):
        _config("")


def test_grain_random_access_source(jsonl):
    rows = files.open_rows(str(jsonl), "auto", files.FieldMap(prompt="question"))
    src = files.PromptRows(rows, files.FieldMap(prompt="question"), "g", indices=[5, 1])
    ds = grain.MapDataset.source(src)
    assert len(ds) == 2 and ds[1].uid == "g:1" and ds[0].uid == "g:5"
    assert rows.where(3) == f"{jsonl}:4"
