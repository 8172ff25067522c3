"""Metric writers (JSONL, TensorBoard, W&B through a fake `wandb`), rollout samples,
(sum, count) reduction, accumulation and progress."""

import io
import json
import math
import pathlib
import struct
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from sao_jax import metrics as M
from sao_jax.report import samples as S
from sao_jax.report.progress import Progress
from sao_jax.sampling.trajectory import Trajectory
from sao_jax.text.tokenizer import CharTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _clock():
    t = iter(range(1000, 2000))
    return lambda: float(next(t))


def _tb_events(logdir):
    """The events of the TFRecord event files (length, crc, data, crc), in order."""
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            yield event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4


def _tb_scalars(logdir):
    """tag -> [(step, value)] of the scalar summaries."""
    out = {}
    for event in _tb_events(logdir):
        for v in event.summary.value:
            if v.HasField("simple_value"):
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def _tb_texts(logdir):
    """tag -> [(step, text)] of the text summaries (tensorboardX: '<tag>/text_summary')."""
    out = {}
    for event in _tb_events(logdir):
        for v in event.summary.value:
            if v.tensor.string_val:
                text = v.tensor.string_val[0].decode()
                out.setdefault(v.tag.removesuffix("/text_summary"), []).append((event.step, text))
    return out


# ----------------------------------------------------------------------------- JSONL


def test_writers_are_clu_metric_writers(tmp_path):
    from clu import metric_writers

    w = M.create_writers(tmp_path, primary=True)
    assert isinstance(w, metric_writers.MultiWriter)
    assert all(isinstance(x, metric_writers.MetricWriter) for x in w._writers)
    w.close()


def test_jsonl_round_trip_and_non_finite(tmp_path):
    path = tmp_path / "m.jsonl"
    w = M.JsonlWriter(path, clock=_clock())
    w.write_scalars(1, {"a": 0.5, "n": np.int32(3), "j": jnp.float32(2.0), "ok": True})
    w.write_scalars(2, {"nan": float("nan"), "inf": np.float32(np.inf), "x": jnp.array([1.5])})
    w.write_texts(2, {"t": "ignored"})
    w.write_hparams({"lr": 1.0})
    w.flush()
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert [json.loads(line) for line in text.splitlines()] == M.read_jsonl(path)
    assert M.read_jsonl(path) == [
        {"step": 1, "time": 1000.0, "a": 0.5, "n": 3, "j": 2.0, "ok": True},
        {"step": 2, "time": 1001.0, "nan": None, "inf": None, "x": 1.5},
    ]
    w.close()


def test_jsonl_rejects_bad_values(tmp_path):
    w = M.JsonlWriter(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="'v'.*shape"):
        w.write_scalars(0, {"v": np.zeros(3)})
    with pytest.raises(TypeError, match="'s'"):
        w.write_scalars(0, {"s": "text"})
    with pytest.raises(ValueError, match="'step' is reserved"):
        w.write_scalars(0, {"step": 1})
    w.close()


def test_jsonl_resume_truncates_and_appends(tmp_path):
    path = tmp_path / "m.jsonl"
    w = M.JsonlWriter(path)
    for s in range(1, 6):
        w.write_scalars(s, {"a": float(s)})
    w.close()
    with path.open("a") as f:
        f.write('{"step": 9, "a"')  # a crash mid-write
    assert [r["step"] for r in M.read_jsonl(path)] == [1, 2, 3, 4, 5]  # torn line skipped
    w = M.JsonlWriter(path)
    assert path.read_text().endswith("}\n")  # torn tail cut on open
    assert w.truncate_after(3) == 2
    w.write_scalars(4, {"a": 40.0})
    w.close()
    assert [(r["step"], r["a"]) for r in M.read_jsonl(path)] == [(1, 1), (2, 2), (3, 3), (4, 40)]


def test_truncate_jsonl_under_an_open_writer(tmp_path):
    w = M.create_writers(tmp_path, tensorboard=False, primary=True)
    for s in range(1, 6):
        w.write_scalars(s, {"a": float(s)})
    assert M.truncate_jsonl(tmp_path, 3) == 2  # the workdir's metrics.jsonl, in place
    w.write_scalars(4, {"a": 40.0})
    w.close()
    path = tmp_path / M.METRICS_FILE
    assert [(r["step"], r["a"]) for r in M.read_jsonl(path)] == [(1, 1), (2, 2), (3, 3), (4, 40)]
    path.write_text('{"step": 1}\n{"step": 5}\n\n{"step": 2}\n')  # steps out of order
    assert M.truncate_jsonl(path, 3) == 1
    assert path.read_text() == '{"step": 1}\n\n{"step": 2}\n'
    assert M.truncate_jsonl(tmp_path / "absent.jsonl", 0) == 0


def test_read_jsonl_names_bad_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2"):
        M.read_jsonl(path)
    path.write_text('{"step": "one"}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:1.*integer 'step'"):
        M.read_jsonl(path)


# ----------------------------------------------------------------------- TensorBoard


def test_tensorboard_scalars_and_resume(tmp_path):
    w = M.create_writers(tmp_path, primary=True)
    for s in range(1, 4):
        w.write_scalars(s, {"policy/loss": 0.1 * s, "bad": float("nan") if s == 2 else 1.0})
    w.write_texts(3, {"note": "hello"})
    w.write_histograms(3, {"h": np.arange(10.0)}, num_buckets={"h": 4})
    w.write_images(3, {"img": np.zeros((4, 4, 3), np.uint8)})
    w.write_hparams({"lr": 1e-3, "steps": 10})
    w.write_summaries(4, {"summ": np.float32(4.0), "vec": np.arange(5.0)})
    w.close()
    tb = _tb_scalars(tmp_path / M.TENSORBOARD_DIR)
    assert [s for s, _ in tb["policy/loss"]] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in tb["policy/loss"]], [0.1, 0.2, 0.3], rtol=1e-6)
    assert [s for s, _ in tb["bad"]] == [1, 3]  # NaN skipped
    assert tb["summ"] == [(4, 4.0)]
    records = M.read_jsonl(tmp_path / M.METRICS_FILE)
    assert [r.get("bad") for r in records] == [1.0, None, 1.0, None]
    assert records[-1]["summ"] == 4.0 and "vec" not in records[-1]

    w = M.create_writers(tmp_path, resume_step=1, primary=True)
    w.write_scalars(2, {"policy/loss": 2.0})
    w.close()
    assert [r["step"] for r in M.read_jsonl(tmp_path / M.METRICS_FILE)] == [1, 2]
    assert len(list((tmp_path / M.TENSORBOARD_DIR).glob("events.out.tfevents.*"))) >= 1


def test_a_training_process_writes_tensorboard_without_importing_torch(tmp_path):
    """torch (installed with the test extras) costs a training process 1-3 s and ~300 MB;
    tensorboardX's writer would import it only to accept torch tensors. Where torch is
    already imported the same writer works too (this test process)."""
    code = (
        "import sys, experiments.train\n"
        "from sao_jax import metrics as M\n"
        f"w = M.TensorboardWriter({str(tmp_path / 'a')!r})\n"
        "w.write_scalars(1, {'x': 2.0})\n"
        "w.close()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "import torch\n"  # and nothing is left hidden
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _tb_scalars(tmp_path / "a") == {"x": [(1, 2.0)]}
    w = M.TensorboardWriter(tmp_path / "b")
    w.write_scalars(3, {"y": 1.0})
    w.close()
    assert _tb_scalars(tmp_path / "b") == {"y": [(3, 1.0)]}


def test_create_writers_switches(tmp_path):
    w = M.create_writers(tmp_path / "a", tensorboard=False, primary=True)
    w.write_scalars(0, {"x": 1.0})
    w.close()
    assert (tmp_path / "a" / M.METRICS_FILE).exists()
    assert not (tmp_path / "a" / M.TENSORBOARD_DIR).exists()
    w = M.create_writers(tmp_path / "b", primary=False)
    w.write_scalars(0, {"x": 1.0})
    w.close()
    assert not (tmp_path / "b").exists()


# ----------------------------------------------------------------- Weights & Biases


def _fake_wandb(monkeypatch):
    """A `wandb` module recording init / log / finish calls (the package is optional and
    not installed by requirements-dev.txt)."""
    calls = []

    class Run:
        def log(self, row, step):
            calls.append(("log", step, row))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    module = types.ModuleType("wandb")
    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_writer_offline_run_and_resume(tmp_path, monkeypatch):
    calls = _fake_wandb(monkeypatch)
    args = dict(project="sao", mode="offline", config={"seed": 0})
    w = M.create_writers(tmp_path / "run", primary=True, wandb=args)
    w.write_scalars(2, {"train/reward": 0.5, "bad": float("nan"), "n": np.int32(3)})
    w.write_texts(2, {"samples": "not sent"})
    w.close()
    (_, init), log, finish = calls
    run_id = (tmp_path / "run" / M.WANDB_DIR / M.WANDB_ID_FILE).read_text().strip()
    assert init == dict(
        project="sao", entity=None, name="run", mode="offline", dir=str(tmp_path / "run"),
        id=run_id, resume="allow", config={"seed": 0},
    )  # fmt: skip
    assert log == ("log", 2, {"train/reward": 0.5, "n": 3}) and finish == ("finish",)
    assert M.read_jsonl(tmp_path / "run" / M.METRICS_FILE)[0]["train/reward"] == 0.5
    M.create_writers(tmp_path / "run", resume_step=2, primary=True, wandb=args).close()
    assert calls[3][1]["id"] == run_id  # a resumed run continues the same W&B run
    calls.clear()
    M.create_writers(tmp_path / "other", primary=False, wandb=args).close()
    assert calls == []  # only the primary process logs


# ------------------------------------------------------------------- rollout samples


def _trajectory(tok, prompt, turns, *, outcome=1.0, version=3, uid="p"):
    """A terminated trajectory of `prompt` then (action text, observation text) turns."""
    ids, action, turn_ids = tok.encode(prompt), [False] * len(tok.encode(prompt)), []
    turn_ids = [-1] * len(ids)
    for i, (a, o) in enumerate(turns):
        ids += tok.encode(a)
        action += [True] * len(a)
        turn_ids += [i] * len(a)
        ids += tok.encode(o)
        action += [False] * len(o)
        turn_ids += [-1] * len(o)
    n = len(ids)
    return Trajectory(
        tokens=np.array(ids, np.int32),
        action_mask=np.array(action),
        rollout_logp=np.zeros(n, np.float32),
        sampled_logp=np.zeros(n, np.float32),
        versions=np.full(n, version, np.int32),
        turn_ids=np.array(turn_ids, np.int32),
        turn_rewards=np.array([0.0] * (len(turns) - 1) + [outcome], np.float32),
        outcome=outcome,
        terminated=True,
        truncated=False,
        prompt_uid=uid,
        info={"success": outcome > 0, "truncation": None},
    )


def test_samples_jsonl_and_tensorboard_text(tmp_path):
    tok = CharTokenizer()
    trajs = [
        _trajectory(tok, "q:2+3\n", [("c:2+3\n", "r:5\n"), ("a:5", "")], uid="a"),
        _trajectory(tok, "q:1+1\n", [("a:3", "")], outcome=0.0, uid="b"),
        _trajectory(tok, "q:4+4\n", [("a:8", "")], uid="c"),
    ]
    w = M.create_writers(tmp_path, primary=True)
    samples = S.SampleWriter(tmp_path, tok, 2, resume_step=-1, primary=True)
    samples.write(5, 4, trajs, w)
    samples.write(10, 9, trajs[1:], w)
    w.close()
    records = M.read_jsonl(tmp_path / S.SAMPLES_FILE)
    assert [(r["step"], r["prompt_uid"]) for r in records] == [
        (5, "a"),
        (5, "b"),
        (10, "b"),
        (10, "c"),
    ]
    assert records[0] == {
        "step": 5, "prompt_uid": "a", "prompt": "q:2+3\n",
        "turns": [{"policy": "c:2+3\n", "env": "r:5\n"}, {"policy": "a:5", "env": ""}],
        "reward": 1.0, "turn_rewards": [0.0, 1.0], "success": True, "truncated": False,
        "truncation": None, "action_tokens": 9, "staleness": 1,
    }  # fmt: skip
    texts = _tb_texts(tmp_path / M.TENSORBOARD_DIR)[S.TEXT_TAG]
    assert [step for step, _ in texts] == [5, 10]
    assert "**a**: reward 1, success True, terminated" in texts[0][1]
    assert "q:2+3\nc:2+3\nr:5\na:5" in texts[0][1]
    S.SampleWriter(tmp_path, tok, 2, resume_step=5, primary=True)  # a resume at step 5
    assert [r["step"] for r in M.read_jsonl(tmp_path / S.SAMPLES_FILE)] == [5, 5]
    S.SampleWriter(tmp_path, tok, 0, resume_step=-1, primary=True).write(1, 0, trajs)
    assert len(M.read_jsonl(tmp_path / S.SAMPLES_FILE)) == 2  # 0 samples: nothing written


# ------------------------------------------------------------------------ reductions


def _value_pairs(v, r, m, prefix="critic"):
    res = r - v
    pair = lambda x: (jnp.float32(np.sum(x * m)), jnp.float32(np.sum(m)))
    return {
        f"{prefix}/value_residual": pair(res),
        f"{prefix}/value_residual_sq": pair(res**2),
        f"{prefix}/returns": pair(r),
        f"{prefix}/returns_sq": pair(r**2),
    }


def _ev_reference(v, r, m):
    sel = m.astype(bool)
    return 1.0 - np.var(r[sel] - v[sel]) / np.var(r[sel])


def test_reduce_sum_count_means_and_explained_variance():
    rng = np.random.default_rng(0)
    r = rng.normal(1.0, 2.0, (4, 16))  # [B, T]
    v = r + rng.normal(0.0, 0.7, (4, 16))
    m = (rng.random((4, 16)) < 0.6).astype(np.float64)
    metrics = _value_pairs(v, r, m) | {
        "policy/keep_rate": (jnp.float32(3.0), jnp.float32(4.0)),
        "empty": (jnp.float32(0.0), jnp.float32(0.0)),
        "reward": 0.25,
        "tokens": np.int64(7),
    }
    out = M.reduce_sum_count(metrics)
    assert out["policy/keep_rate"] == 0.75 and out["reward"] == 0.25 and out["tokens"] == 7.0
    assert math.isnan(out["empty"])
    sel = m.astype(bool)
    np.testing.assert_allclose(out["critic/returns"], r[sel].mean(), rtol=1e-5)
    np.testing.assert_allclose(out["critic/returns_std"], r[sel].std(), rtol=1e-4)
    np.testing.assert_allclose(out["critic/explained_variance"], _ev_reference(v, r, m), atol=1e-4)
    assert "empty_std" not in out and "policy/explained_variance" not in out


def test_explained_variance_edge_cases():
    r = np.full((2, 3), 2.0)
    m = np.ones((2, 3))
    out = M.reduce_sum_count(_value_pairs(r - 1.0, r, m))
    assert out["critic/explained_variance"] == 0.0  # Var(R) = 0, as on the device
    out = M.reduce_sum_count(_value_pairs(r, r, np.zeros((2, 3))))
    assert math.isnan(out["critic/explained_variance"])  # no tokens counted
    ev = M.derived_metrics({"c/value_residual": 0.0, "c/value_residual_sq": 1.0})
    assert ev == {"c/value_residual_std": 1.0}  # returns missing: no EV


def test_reduce_sum_count_rejects_bad_values():
    with pytest.raises(TypeError, match="'x'"):
        M.reduce_sum_count({"x": (1.0, 2.0, 3.0)})
    with pytest.raises(TypeError, match="'y'"):
        M.reduce_sum_count({"y": "text"})


def test_accumulator_sums_pairs_over_steps():
    rng = np.random.default_rng(1)
    acc = M.MetricAccumulator()
    vs, rs, ms = [], [], []
    for step in range(3):
        r = rng.normal(size=(2, 8))
        v = r + rng.normal(scale=0.5, size=(2, 8))
        m = (rng.random((2, 8)) < 0.7).astype(np.float64)
        vs.append(v)
        rs.append(r)
        ms.append(m)
        step_metrics = _value_pairs(v, r, m)
        if step != 1:  # a name missing in one step counts only where present
            step_metrics["policy/keep_rate"] = (jnp.float32(step + 1), jnp.float32(4))
        acc.add(step_metrics)
    assert len(acc) == 3
    out = acc.result()
    assert len(acc) == 0
    np.testing.assert_allclose(out["policy/keep_rate"], (1 + 3) / 8)
    v, r, m = (np.concatenate(x) for x in (vs, rs, ms))
    np.testing.assert_allclose(out["critic/explained_variance"], _ev_reference(v, r, m), atol=1e-4)
    assert acc.result() == {}
    with pytest.raises(TypeError, match="'loss'"):
        acc.add({"loss": jnp.float32(1.0)})


# -------------------------------------------------------------------------- progress


def test_progress_plain_lines_when_not_a_tty():
    stream, now = io.StringIO(), [0.0]
    p = Progress(10, stream=stream, every_s=10.0, primary=True, clock=lambda: now[0])
    for step in range(1, 11):
        now[0] = 4.0 * step
        p.update(step, {"train/reward": 0.5, "perf/action_tokens_per_s": 1234.0, "other": 1.0})
    p.close()
    lines = stream.getvalue().splitlines()
    # printed at step 1 (first), then whenever >= 10 s passed, and at the last step
    assert [line.split()[1] for line in lines] == ["1/10", "4/10", "7/10", "10/10"]
    assert "reward 0.5" in lines[0] and "tok/s 1234" in lines[0] and "success" not in lines[0]
    assert "eta 0:00:24" in lines[1]  # 6 steps left at 4 s per step (rate from the start)
    assert "eta 0:00:00" in lines[-1]


def test_progress_close_prints_last_step_and_resume():
    stream = io.StringIO()
    p = Progress(100, initial=50, stream=stream, every_s=1e9, primary=True, clock=_clock())
    p.update(51)
    p.update(60)
    p.close()
    p.close()
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["51/100", "60/100"]
    with pytest.raises(ValueError, match="initial"):
        Progress(10, initial=11)


def test_progress_tty_bar_and_disabled():
    stream = io.StringIO()
    with Progress(5, stream=stream, tty=True, primary=True) as p:
        for step in range(1, 6):
            p.update(step, {"train/success": 0.25})
    out = stream.getvalue()
    assert "5/5" in out and "success 0.25" in out
    quiet = io.StringIO()
    with Progress(5, stream=quiet, primary=False) as p:
        p.update(5)
    with Progress(5, stream=quiet, enabled=False, primary=True) as p:
        p.update(5)
    assert quiet.getvalue() == ""
