r"""Starts a run (or a sweep) on a TPU pod slice or a GPU cluster: one process per host.

TPU pod: one `gcloud compute tpus tpu-vm ssh --worker=all` runs the same command on
every worker at once; `--distributed=detect` lets jax.distributed find the others.

  python -m experiments.launch --target=tpu --tpu_name=sao-v5p-128 --zone=us-east5-a \
      --config=configs/qwen3_30b_a3b_sao.py --workdir=/mnt/runs/sao30b --dry_run

GPU cluster: one ssh per host (process i of N, coordinator = the first host), or one
`srun` over the allocation (jax detects SLURM):

  python -m experiments.launch --target=gpu --hosts=h1,h2 --gpus_per_host=8 \
      --config=configs/qwen3_30b_a3b_sao.py:gpus=16 --workdir=/mnt/runs/sao30b --dry_run

Extra flags for experiments.train go after `--` (`-- --config.seed=1`). The sweep
runner hands whole point commands the same way (`--platform=tpu --name=<point> --
experiments.train --config=... --workdir=...`, see sao_jax/sweep/); `--sweep` runs
every point of a config's `get_sweep()` one after the other. `--dry_run` prints the
exact commands; without it they run here through subprocess (each host's output
streams to this terminal) and the exit code is the worst of theirs.

Cluster flags default to environment variables SAO_<FLAG> (SAO_TPU_NAME, SAO_ZONE,
SAO_HOSTS, ...), so the sweep runner needs only --platform. The workdir must be a path
every host sees (NFS, a gcsfuse mount of a bucket): checkpoints are written collectively.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from absl import app, flags

from sao_jax.cli import entry_module
from sao_jax.schema import ConfigError

TARGETS = ("tpu", "gpu")
GPU_LAUNCHERS = ("ssh", "srun")
TRAIN_MODULE = entry_module("experiments.train")  # installed: sao_jax.experiments.train
DEFAULT_PORT = 8476


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where and how the hosts' processes start."""

    target: str  # 'tpu' | 'gpu'
    tpu_name: str = ""
    zone: str = ""
    project: str = ""
    hosts: tuple[str, ...] = ()  # GPU hosts; the first one runs the coordinator
    gpus_per_host: int = 8
    port: int = DEFAULT_PORT  # coordinator port on the first host
    gpu_launcher: str = "ssh"  # 'ssh' (one per host) | 'srun' (one over the allocation)
    repo_dir: str = "~/sao_jax"  # checkout of this repository on every host
    python: str = "python3"  # interpreter on the hosts
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the remote processes

    def check(self) -> None:
        """Raises ConfigError naming the flag of a missing or bad setting."""
        if self.target not in TARGETS:
            raise ConfigError(f"flag --target: {self.target!r} is not one of {TARGETS}")
        if self.target == "tpu":
            for flag in ("tpu_name", "zone"):
                if not getattr(self, flag):
                    raise ConfigError(f"flag --{flag}: needed with --target=tpu")
            return
        if not self.hosts:
            raise ConfigError("flag --hosts: needed with --target=gpu (comma-separated)")
        if len(set(self.hosts)) != len(self.hosts):
            raise ConfigError(f"flag --hosts: repeated host in {','.join(self.hosts)}")
        if self.gpus_per_host < 1:
            raise ConfigError(f"flag --gpus_per_host: must be >= 1, got {self.gpus_per_host}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"flag --coordinator_port: {self.port} is not a TCP port")
        if self.gpu_launcher not in GPU_LAUNCHERS:
            raise ConfigError(f"flag --gpu_launcher: {self.gpu_launcher!r} not in {GPU_LAUNCHERS}")

    @property
    def num_processes(self) -> int:
        return len(self.hosts) if self.target == "gpu" else 0  # TPU: detected on the pod


def parse_env(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """['K=V', ...] -> ((K, V), ...); ConfigError naming --env for an item without '='."""
    out = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise ConfigError(f"flag --env: {item!r} is not NAME=value")
        out.append((key, value))
    return tuple(out)


def check_workdir(workdir: str) -> None:
    """The run's workdir is a file-system path (pathlib), shared by all hosts."""
    if "://" in workdir:
        raise ConfigError(
            f"flag --workdir: {workdir!r} is a URL; the run writes its workdir through the "
            "file system (config.json, metrics, checkpoints), so mount the bucket on every "
            "host (e.g. gcsfuse at /mnt/bucket) and pass the mounted path"
        )


def train_argv(module: str, train_flags: Sequence[str], python: str) -> list[str]:
    """`python -m module flags...` as run on each host."""
    return [python, "-m", module, *train_flags]


def _remote_shell(cluster: Cluster, argv: Sequence[str], env: Mapping[str, str]) -> str:
    """`cd <repo> && K=V ... <argv>`: one shell line for ssh / srun bash -c."""
    assignments = [f"{k}={shlex.quote(v)}" for k, v in {**dict(cluster.env), **env}.items()]
    repo = cluster.repo_dir
    cd = f"cd {repo}" if repo.startswith("~") else f"cd {shlex.quote(repo)}"
    return " ".join([cd, "&&", *assignments, shlex.join(list(argv))])


def tpu_commands(cluster: Cluster, argv: Sequence[str]) -> list[list[str]]:
    """One gcloud command: the same process on every worker, jax detects the pod."""
    shell = _remote_shell(cluster, [*argv, "--distributed=detect"], {})
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", cluster.tpu_name]
    cmd += [f"--zone={cluster.zone}"]
    if cluster.project:
        cmd += [f"--project={cluster.project}"]
    return [[*cmd, "--worker=all", f"--command={shell}"]]


def gpu_commands(cluster: Cluster, argv: Sequence[str]) -> list[list[str]]:
    """ssh: one command per host (coordinator = first host, process i of N);
    srun: one command over the allocation's nodes (jax reads SLURM's variables)."""
    n, g = len(cluster.hosts), cluster.gpus_per_host
    visible = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(g)))}
    if cluster.gpu_launcher == "srun":
        shell = _remote_shell(
            cluster, [*argv, "--distributed=detect"], {"JAX_COORDINATOR_PORT": str(cluster.port)}
        )
        return [
            [
                "srun", f"--nodes={n}", "--ntasks-per-node=1", f"--gpus-per-node={g}",
                f"--nodelist={','.join(cluster.hosts)}", "bash", "-c", shell,
            ]
        ]  # fmt: skip
    coordinator = f"{cluster.hosts[0]}:{cluster.port}"
    out = []
    for i, host in enumerate(cluster.hosts):
        dist_flags = [
            f"--coordinator_address={coordinator}",
            f"--num_processes={n}",
            f"--process_id={i}",
        ]
        out.append(["ssh", host, _remote_shell(cluster, [*argv, *dist_flags], visible)])
    return out


def host_commands(cluster: Cluster, argv: Sequence[str]) -> list[list[str]]:
    """The commands that start `argv` on every host of the cluster."""
    cluster.check()
    return tpu_commands(cluster, argv) if cluster.target == "tpu" else gpu_commands(cluster, argv)


def sweep_argvs(config: str, workdir: str, python: str) -> list[tuple[str, list[str]]]:
    """(name, argv) of every run of `config`'s get_sweep(), seed by seed: each seed's
    shared warm start, then its points (workdir/<point name>), in the order and with the
    commands sao_jax.sweep runs them."""
    from sao_jax import sweep

    spec = sweep.load_sweep(config)
    jobs = sweep.seed_order((spec,), [sweep.sweep_jobs(spec, workdir, python=python)])
    return [(job.name, job.argv) for job in jobs]


def run_commands(
    cmds: Sequence[Sequence[str]],
    *,
    dry_run: bool,
    log: Callable[[str], None] = print,
    popen: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> int:
    """Prints (dry run) or starts all commands at once and waits; the worst exit code."""
    for cmd in cmds:
        log(shlex.join(cmd))
    if dry_run:
        return 0
    procs = [popen(list(cmd)) for cmd in cmds]
    try:
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return max(codes, key=abs) if codes else 0


def launch(
    cluster: Cluster,
    *,
    config: str | None,
    workdir: str | None,
    rest: Sequence[str],
    sweep: bool = False,
    name: str = "",
    dry_run: bool = True,
    log: Callable[[str], None] = print,
    popen: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> int:
    """Builds the runs' host commands and prints or runs them (one run after the other).

    `rest` (after `--`) is either extra flags for experiments.train (starting with '-'),
    or a whole command `<module> <flags...>` (the sweep runner's form; then no
    --config/--workdir).
    """
    cluster.check()
    if rest and not rest[0].startswith("-"):
        if config or workdir or sweep:
            raise ConfigError(
                "flags --config/--workdir/--sweep: not allowed with a whole command after --"
            )
        for f in rest:
            if f.startswith("--workdir="):
                check_workdir(f.partition("=")[2])
        runs = [(name or rest[0], train_argv(rest[0], rest[1:], cluster.python))]
    else:
        if not config or not workdir:
            raise ConfigError("flags --config and --workdir: both needed (or a command after --)")
        check_workdir(workdir)
        if sweep:
            runs = [(n, [*argv, *rest]) for n, argv in sweep_argvs(config, workdir, cluster.python)]
        else:
            args = [f"--config={config}", f"--workdir={workdir}", *rest]
            runs = [(name or "run", train_argv(TRAIN_MODULE, args, cluster.python))]
    worst = 0
    for run_name, argv in runs:
        log(f"# {run_name}")
        code = run_commands(host_commands(cluster, argv), dry_run=dry_run, log=log, popen=popen)
        worst = code if worst == 0 else worst
    return worst


# ------------------------------------------------------------------------------ flags


def _env(name: str, default: str = "") -> str:
    return os.environ.get(f"SAO_{name.upper()}", default)


def define_flags() -> dict[str, flags.FlagHolder]:
    """The command-line flags (defined only when run as a program, so that importing this
    module next to other entry points never defines a flag twice)."""
    d = dict(
        target=flags.DEFINE_enum("target", _env("target") or None, TARGETS, "tpu or gpu."),
        config=flags.DEFINE_string("config", None, "Run config file[:variant] (on the hosts)."),
        workdir=flags.DEFINE_string("workdir", None, "Run directory every host sees."),
        sweep=flags.DEFINE_bool("sweep", False, "Run every point of the config's get_sweep()."),
        name=flags.DEFINE_string("name", "", "Label of this run in the output."),
        dry_run=flags.DEFINE_bool("dry_run", False, "Print the exact commands; run nothing."),
        tpu_name=flags.DEFINE_string("tpu_name", _env("tpu_name"), "TPU VM (pod slice) name."),
        zone=flags.DEFINE_string("zone", _env("zone"), "TPU zone."),
        project=flags.DEFINE_string("project", _env("project"), "GCP project (optional)."),
        hosts=flags.DEFINE_list("hosts", _env("hosts"), "GPU hosts; the first coordinates."),
        gpus=flags.DEFINE_integer("gpus_per_host", int(_env("gpus_per_host", "8")), "GPUs/host."),
        port=flags.DEFINE_integer(
            "coordinator_port", int(_env("coordinator_port", str(DEFAULT_PORT))), "Its port."
        ),
        gpu_launcher=flags.DEFINE_enum(
            "gpu_launcher", _env("gpu_launcher", "ssh"), GPU_LAUNCHERS, "ssh per host, or srun."
        ),
        repo_dir=flags.DEFINE_string("repo_dir", _env("repo_dir", "~/sao_jax"), "Repo on hosts."),
        python=flags.DEFINE_string("python", _env("python", "python3"), "Python on the hosts."),
        env=flags.DEFINE_multi_string("env", [], "NAME=value for the remote processes."),
    )
    flags.DEFINE_alias("platform", "target")  # the sweep runner's spelling
    return d


def main(argv: Sequence[str], f: Mapping[str, flags.FlagHolder]) -> None:
    try:
        cluster = Cluster(
            target=f["target"].value or "",
            tpu_name=f["tpu_name"].value,
            zone=f["zone"].value,
            project=f["project"].value,
            hosts=tuple(f["hosts"].value),
            gpus_per_host=f["gpus"].value,
            port=f["port"].value,
            gpu_launcher=f["gpu_launcher"].value,
            repo_dir=f["repo_dir"].value,
            python=f["python"].value,
            env=parse_env(f["env"].value),
        )
        code = launch(
            cluster,
            config=f["config"].value,
            workdir=f["workdir"].value,
            rest=argv[1:],
            sweep=f["sweep"].value,
            name=f["name"].value,
            dry_run=f["dry_run"].value,
        )
    except ConfigError as e:
        raise app.UsageError(str(e)) from e
    sys.exit(code)


if __name__ == "__main__":
    _holders = define_flags()
    app.run(lambda argv: main(argv, _holders))
