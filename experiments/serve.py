r"""Serves a run config's policy behind the OpenAI-compatible rollout gateway.

  python -m experiments.serve --config=configs/harness.py:smoke --workdir=/tmp/gw
  python -m experiments.serve --config=configs/harness.py --workdir=DIR --host=0.0.0.0 \
      --port=8000

Once it accepts connections it writes DIR/gateway.json (base_url, api_key, port, model,
pid); finished episodes go to DIR/episodes.jsonl. Serves the config's `init` policy
without running SFT. SIGTERM or Ctrl-C stops it (exit 0). docs/harness.md has the contract.
"""

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from sao_jax import cli
from sao_jax.serve.gateway import GatewayConfig

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file[:variant].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for gateway.json and episodes.jsonl.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (others: a warning).")
_PORT = flags.DEFINE_integer("port", 0, "Port; 0 picks a free one (gateway.json says which).")
_MODEL = flags.DEFINE_string("model_name", GatewayConfig.model_name, "The served model's name.")
_REWARD_TIMEOUT = flags.DEFINE_float(
    "reward_timeout_s", GatewayConfig.reward_timeout_s, "Episodes with no reward are ended."
)
_STRICT = flags.DEFINE_bool(
    "strict_sampling", False, "Refuse (400) requests whose sampling knobs differ from the run's."
)
flags.mark_flags_as_required(["config", "workdir"])


@cli.guard
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)
    import logging
    import sys

    from sao_jax.serve.launch import serve

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("sao_jax")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    cfg = GatewayConfig(
        model_name=_MODEL.value,
        reward_timeout_s=_REWARD_TIMEOUT.value,
        strict_sampling=_STRICT.value,
    )
    serve(_CONFIG.value, _WORKDIR.value, cfg, host=_HOST.value, port=_PORT.value)


def cli_main() -> None:
    """The `sao-serve` console script."""
    app.run(main, flags_parser=cli.parse_config_flags)


if __name__ == "__main__":
    cli_main()
