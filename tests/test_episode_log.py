"""sao_jax/serve/episodes.py: concurrent writers commit as a group (every line once,
whole, on disk before its writer returns, fewer fsyncs than lines), and a failed write
raises in its writer and loses no other writer's line."""

import json
import threading

import pytest

from sao_jax.serve import episodes as episodes_lib
from sao_jax.serve.episodes import EpisodeLog

WRITERS = 24


def _write_all(log: EpisodeLog, n: int) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def one(i: int) -> None:
        start.wait()
        try:
            log.write({"id": f"e{i}", "reward": None if i % 3 else 1.0, "dropped": None,
                       "text": "ünïcode " * 50})  # fmt: skip
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_concurrent_writers_share_fsyncs_and_every_line_lands_whole(tmp_path, monkeypatch):
    synced: list[int] = []  # lines on disk at each fsync
    seen: list[str] = []
    log = EpisodeLog(tmp_path / "episodes.jsonl", on_episode=lambda r: seen.append(r["id"]))
    real_fsync = episodes_lib.os.fsync

    def slow_fsync(fd):  # a disk that takes a while, so writers arrive during a commit
        threading.Event().wait(0.02)
        real_fsync(fd)
        synced.append(len(log.path.read_text(encoding="utf-8").splitlines()))

    monkeypatch.setattr(episodes_lib.os, "fsync", slow_fsync)
    assert _write_all(log, WRITERS) == []
    lines = log.path.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]  # each line whole
    assert sorted(r["id"] for r in records) == sorted(f"e{i}" for i in range(WRITERS))
    assert sorted(seen) == sorted(r["id"] for r in records)  # each seen once, after disk
    assert log.written == WRITERS and log.dropped == 0
    assert 1 <= len(synced) < WRITERS, synced  # grouped: fewer fsyncs than lines
    assert synced[-1] == WRITERS


def test_a_failed_commit_raises_in_its_writers_and_the_others_land(tmp_path, monkeypatch):
    log = EpisodeLog(tmp_path / "episodes.jsonl")
    with pytest.raises(TypeError):  # a record JSON cannot encode fails before the queue
        log.write({"bad": _Unencodable()})
    real_open = open
    opened: list[int] = []

    def flaky_open(*args, **kwargs):  # the first commit fails (a full disk), later ones not
        opened.append(1)
        if len(opened) == 1:
            threading.Event().wait(0.05)  # while the others queue behind it
            raise OSError(28, "No space left on device")
        return real_open(*args, **kwargs)

    monkeypatch.setattr(episodes_lib, "open", flaky_open, raising=False)
    errors = _write_all(log, 8)
    assert errors and all("No space left" in str(e) for e in errors)
    ids = [json.loads(x)["id"] for x in log.path.read_text(encoding="utf-8").splitlines()]
    assert len(ids) == len(set(ids)) == 8 - len(errors)  # the failed batch's lines only lost
    assert log.written == len(ids)
    log.write({"id": "later"})  # the log goes on
    assert log.path.read_text(encoding="utf-8").splitlines()[-1] == '{"id": "later"}'


class _Unencodable:
    def __str__(self):
        raise TypeError("no text form")
