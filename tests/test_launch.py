"""The pod / cluster launcher: exact dry-run commands, sweeps, errors, and execution."""

import os
import pathlib
import shlex
import subprocess
import sys

import numpy as np
import pytest

from experiments import launch as L
from sao_jax.schema import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
TPU = L.Cluster("tpu", tpu_name="sao-pod", zone="us-east5-a", project="proj")
GPU = L.Cluster("gpu", hosts=("h1", "h2"), gpus_per_host=8)


def _dry(cluster, **kw) -> list[str]:
    lines: list[str] = []
    kw.setdefault("rest", [])
    assert L.launch(cluster, dry_run=True, log=lines.append, **kw) == 0
    return lines


def test_tpu_dry_run_is_one_gcloud_ssh_to_every_worker():
    lines = _dry(TPU, config="configs/sao.py:smoke", workdir="/mnt/w", rest=["--config.seed=1"])
    assert lines == [
        "# run",
        "gcloud compute tpus tpu-vm ssh sao-pod --zone=us-east5-a --project=proj --worker=all "
        "'--command=cd ~/sao_jax && python3 -m experiments.train "
        "--config=configs/sao.py:smoke --workdir=/mnt/w --config.seed=1 --distributed=detect'",
    ]
    inner = shlex.split(lines[1])[-1].removeprefix("--command=")
    assert shlex.split(inner)[3:6] == ["python3", "-m", "experiments.train"]


def test_gpu_dry_run_is_one_ssh_per_host_with_coordinator_count_and_id():
    lines = _dry(GPU, config="configs/sao.py", workdir="/mnt/w")
    assert lines[0] == "# run" and len(lines) == 3
    for i, (line, host) in enumerate(zip(lines[1:], ("h1", "h2"), strict=True)):
        ssh, target, shell = shlex.split(line)
        assert (ssh, target) == ("ssh", host)
        assert shell == (
            "cd ~/sao_jax && CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 python3 -m experiments.train "
            "--config=configs/sao.py --workdir=/mnt/w --coordinator_address=h1:8476 "
            f"--num_processes=2 --process_id={i}"
        )


def test_gpu_srun_and_remote_settings():
    cluster = L.Cluster(
        "gpu", hosts=("n1", "n2", "n3"), gpus_per_host=4, port=9000, gpu_launcher="srun",
        repo_dir="/opt/my repo", python=".venv/bin/python", env=(("XLA_FLAGS", "--a --b"),),
    )  # fmt: skip
    (_, line) = _dry(cluster, config="c.py", workdir="/w")
    argv = shlex.split(line)
    assert argv[:6] == [
        "srun", "--nodes=3", "--ntasks-per-node=1", "--gpus-per-node=4", "--nodelist=n1,n2,n3",
        "bash",
    ]  # fmt: skip
    assert argv[6:7] == ["-c"]
    assert argv[7] == (
        "cd '/opt/my repo' && XLA_FLAGS='--a --b' JAX_COORDINATOR_PORT=9000 .venv/bin/python "
        "-m experiments.train --config=c.py --workdir=/w --distributed=detect"
    )


def test_whole_command_form_of_the_sweep_runner():
    rest = ["experiments.train", "--config=configs/sao.py:smoke", "--workdir=/s/p__seed=0"]
    lines = _dry(TPU, config=None, workdir=None, rest=rest, name="p__seed=0")
    assert lines[0] == "# p__seed=0"
    assert "python3 -m experiments.train --config=configs/sao.py:smoke" in lines[1]
    assert "--workdir=/s/p__seed=0 --distributed=detect" in lines[1]
    with pytest.raises(ConfigError, match="--config/--workdir/--sweep"):
        L.launch(TPU, config="c.py", workdir=None, rest=rest)


def test_sweep_runs_every_point(tmp_path):
    cfg = tmp_path / "sweep_cfg.py"
    cfg.write_text(
        "from sao_jax.sweep import SweepSpec, axis\n"
        "def get_sweep(arg=None):\n"
        "    return SweepSpec(name='t', config='configs/sao.py', variants=('smoke',),\n"
        "                     seeds=(0, 1), grid=(axis('rl.k_critic', [1, 2]),),\n"
        "                     warm_start=False)\n"
    )
    lines = _dry(GPU, config=str(cfg), workdir="/mnt/s", sweep=True, rest=["--config.x=1"])
    names = [ln[2:] for ln in lines if ln.startswith("# ")]
    assert len(names) == 4 and len(lines) == 4 * 3  # 4 points x (name + 2 hosts)
    for name in names:
        block = lines[lines.index(f"# {name}") + 1 : lines.index(f"# {name}") + 3]
        for pid, line in enumerate(block):
            assert f"--workdir=/mnt/s/{name}" in line
            assert "--config=configs/sao.py:smoke" in line and "--config.x=1" in line
            assert f"--num_processes=2 --process_id={pid}" in line
    assert {n.split("__seed=")[1] for n in names} == {"0", "1"}


def test_execution_starts_every_host_and_returns_the_worst_exit_code():
    started = []

    class FakeProc:
        def __init__(self, argv):
            started.append(argv)
            self.code = 3 if argv[1] == "h2" else 0

        def wait(self):
            return self.code

        def poll(self):
            return self.code

    code = L.launch(
        GPU, config="c.py", workdir="/w", rest=[], dry_run=False, log=lambda s: None,
        popen=FakeProc,
    )  # fmt: skip
    assert code == 3 and [a[1] for a in started] == ["h1", "h2"]


@pytest.mark.parametrize(
    "cluster, kw, match",
    [
        (L.Cluster("tpu", zone="z"), {}, "--tpu_name"),
        (L.Cluster("tpu", tpu_name="p"), {}, "--zone"),
        (L.Cluster("gpu"), {}, "--hosts"),
        (L.Cluster("gpu", hosts=("a", "a")), {}, "--hosts"),
        (L.Cluster("gpu", hosts=("a",), gpus_per_host=0), {}, "--gpus_per_host"),
        (L.Cluster("gpu", hosts=("a",), port=0), {}, "--coordinator_port"),
        (L.Cluster("cpu"), {}, "--target"),
        (TPU, dict(workdir="gs://bucket/run"), "--workdir.*mount"),
        (TPU, dict(workdir=None), "--config and --workdir"),
    ],
)
def test_errors_name_the_flag(cluster, kw, match):
    kw = {"config": "c.py", "workdir": "/w", **kw}
    with pytest.raises(ConfigError, match=match):
        L.launch(cluster, rest=[], log=lambda s: None, **kw)


def test_parse_env():
    assert L.parse_env(["A=1", "B=x=y"]) == (("A", "1"), ("B", "x=y"))
    with pytest.raises(ConfigError, match="--env"):
        L.parse_env(["novalue"])


def test_command_line_dry_run():
    env = dict(os.environ, SAO_TPU_NAME="pod", SAO_ZONE="z")
    out = subprocess.run(
        [sys.executable, "-m", "experiments.launch", "--platform=tpu", "--name=pt", "--dry_run",
         "--", "experiments.train", "--config=configs/sao.py", "--workdir=/w"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.splitlines() == [
        "# pt",
        "gcloud compute tpus tpu-vm ssh pod --zone=z --worker=all '--command=cd ~/sao_jax && "
        "python3 -m experiments.train --config=configs/sao.py --workdir=/w --distributed=detect'",
    ]


@pytest.mark.parametrize(
    "variant, devices", [("", 64), ("gpus=8,replay", 8), ("gpus=16", 16), ("paged", 64)]
)
def test_30b_config_validates_and_its_batch_splits_on_its_mesh(variant, devices):
    """The config the launcher runs at scale: valid, and 128 rows split evenly over the
    microbatches x data-parallel shards of its mesh (abstract: no devices needed)."""
    from sao_jax import config as config_lib
    from sao_jax.parallel.mesh import Sharder
    from sao_jax.plan.memory import abstract_mesh

    c = config_lib.load_config(f"configs/qwen3_30b_a3b_sao.py:{variant}")
    c = config_lib.validate(c)  # field names and types, then ranges
    sizes = dict(zip(c.mesh.axes, c.mesh.shape, strict=True))
    assert np.prod(list(sizes.values())) == devices
    shards = Sharder(abstract_mesh(sizes), tuple(map(tuple, c.mesh.rules))).axis_size("batch")
    assert c.rl.batch_size == 128 and c.rl.k_critic == 2 and c.init.kind == "hf"
    assert c.rl.batch_size % (shards * c.rl.microbatches) == 0
    assert (c.rl.losses.dis.eps_l, c.rl.losses.dis.eps_h) == (0.3, 5.0)  # keep (0.7, 6.0)
    assert (c.optim.policy.lr, c.optim.critic.lr) == (1e-6, 5e-6)
    assert c.model.dtype == "bfloat16"
    assert c.rl.routing_replay == c.sampling.record_routing == ("replay" in variant)
