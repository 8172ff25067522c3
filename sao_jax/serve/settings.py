"""The `gateway` config section: its checks and the settings objects built from it.

One source of truth for the gateway's settings (sao_jax/defaults.py `gateway_section`,
one comment per field): `experiments/serve.py` and a training run with `gateway.mode`
'harness' or 'live' both read them; the serve entry point's flags (`--host`, `--port`,
...) only override fields of this section.

`gateway_config(section, training=...)` is the `GatewayConfig` of sao_jax/serve/gateway.py
(in training the run's sampling law applies: `request_sampling=False`);
`harness_config(section)` the `HarnessConfig` of the harness driver
(sao_jax/serve/harness.py). The command template of `gateway.harness.command` is split
like a shell line (`shlex`), then each word is formatted with the placeholders below, so
`{task_json}` is always one argument whatever it holds.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import string

from sao_jax.schema import ConfigDict, ConfigError, register_validator, require

MODES = ("off", "harness", "live")
# what a harness command may name: the session's OpenAI base URL and key, the task as
# JSON, this interpreter, the harness's own working directory
PLACEHOLDERS = ("base_url", "api_key", "task_json", "python", "workdir")


@dataclasses.dataclass(frozen=True)
class HarnessConfig:
    """How the training driver runs harness processes (sao_jax/serve/harness.py)."""

    command: tuple[str, ...] = ()  # the template's words (placeholders unformatted)
    processes: int = 2  # harness processes running at once
    timeout_s: float = 600.0  # a process running longer is killed (its episode dropped)
    sandbox: bool = False  # run each inside bubblewrap (sao_jax/serve/harness_sandbox.py)
    sandbox_paths: tuple[str, ...] = ()  # read-only paths the harness needs inside


def gateway_config(section: ConfigDict, *, training: bool):
    """The gateway's `GatewayConfig`; in training the run's sampling law applies."""
    from sao_jax.serve.gateway import GatewayConfig  # the validator stays light

    return GatewayConfig(
        model_name=section.model_name,
        max_tokens=section.max_tokens,
        max_body_bytes=section.max_body_bytes,
        reward_timeout_s=float(section.reward_timeout_s),
        request_sampling=not training,
        strict_sampling=section.strict_sampling,
    )


def command_words(command: str) -> tuple[str, ...]:
    """The template split like a shell line; ConfigError naming the field when it does
    not split or names an unknown placeholder."""
    field = "gateway.harness.command"
    try:
        words = tuple(shlex.split(command))
    except ValueError as e:
        raise ConfigError(f"config field {field}: {e}") from None
    for word in words:
        try:
            names = [n for _, n, _, _ in string.Formatter().parse(word) if n is not None]
        except ValueError as e:
            raise ConfigError(f"config field {field}: {word!r}: {e}") from None
        for name in names:
            require(
                name in PLACEHOLDERS,
                field,
                f"unknown placeholder {{{name}}} in {word!r}; known: {list(PLACEHOLDERS)}",
            )
    return words


def _check_admission(section: ConfigDict) -> None:
    """The native backend's admission windows (`admit_gap_s`, `admit_wait_s`): ConfigError
    naming the field unless 0 <= gap <= wait."""
    from sao_jax.sampling.backend_native import check_admission

    gap, wait = float(section.admit_gap_s), float(section.admit_wait_s)
    try:
        check_admission(gap, wait)
    except ValueError as e:  # "<field>: <why>"
        raise ConfigError(f"config field gateway.{e}") from None


def harness_config(section: ConfigDict) -> HarnessConfig:
    h = section.harness
    return HarnessConfig(
        command=command_words(h.command),
        processes=h.processes,
        timeout_s=float(h.timeout_s),
        sandbox=h.sandbox,
        sandbox_paths=tuple(h.sandbox_paths),
    )


@register_validator("gateway")
def _check_gateway(config: ConfigDict) -> None:
    g = config.gateway
    require(g.mode in MODES, "gateway.mode", f"must be one of {MODES}, got {g.mode!r}")
    require(0 <= g.port < 65536, "gateway.port", f"must be in [0, 65536), got {g.port}")
    require(bool(g.model_name), "gateway.model_name", "must not be empty")
    require(g.max_tokens >= 0, "gateway.max_tokens", f"must be >= 0, got {g.max_tokens}")
    require(g.max_body_bytes > 0, "gateway.max_body_bytes", "must be > 0")
    require(g.reward_timeout_s > 0, "gateway.reward_timeout_s", "must be > 0")
    _check_admission(g)
    require(
        g.max_staleness is None or g.max_staleness >= 0,
        "gateway.max_staleness",
        f"must be >= 0 or None (off), got {g.max_staleness}",
    )
    h = g.harness
    words = command_words(h.command)
    require(h.processes >= 1, "gateway.harness.processes", f"must be >= 1, got {h.processes}")
    require(h.timeout_s > 0, "gateway.harness.timeout_s", "must be > 0")
    if g.mode == "off":
        return
    require(
        g.mode != "harness" or bool(words),
        "gateway.harness.command",
        "gateway.mode='harness' runs this command per task: give one, e.g. "
        "'{python} agent.py --base_url={base_url} --api_key={api_key} --task={task_json}'",
    )
    if "train" in config:
        require(
            config.train.rollouts == "async",
            "gateway.mode",
            f"{g.mode!r} trains on episodes as they end: needs train.rollouts='async', got "
            f"{config.train.rollouts!r}",
        )
    if "env" in config:
        require(
            config.env.group_size == 1,
            "gateway.mode",
            f"{g.mode!r} gives one episode per task (single rollouts): needs "
            f"env.group_size=1, got {config.env.group_size}",
        )
    if "sampling" in config:
        require(
            config.sampling.get("placement", "colocated") == "colocated",
            "gateway.mode",
            f"{g.mode!r} serves from one backend on the trainer's devices: needs "
            "sampling.placement='colocated'",
        )
        require(
            not config.sampling.get("record_routing", False),
            "sampling.record_routing",
            f"gateway.mode={g.mode!r}: the gateway's episodes carry no routing records "
            "(routing replay trains on in-process rollouts only)",
        )
    if g.mode == "harness" and h.sandbox:
        from sao_jax.serve.harness_sandbox import unavailable

        why = unavailable()
        require(not why, "gateway.harness.sandbox", f"bubblewrap sandbox unavailable: {why}")
        for path in h.sandbox_paths:
            require(
                os.path.exists(path),
                "gateway.harness.sandbox_paths",
                f"{path!r} does not exist (the harness's code, bound read-only)",
            )
