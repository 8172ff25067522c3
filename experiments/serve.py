r"""Serves a run config's policy behind the OpenAI-compatible rollout gateway.

  python -m experiments.serve --config=configs/harness.py:smoke --workdir=/tmp/gw
  python -m experiments.serve --config=configs/harness.py --workdir=DIR --host=0.0.0.0 \
      --port=8000

Once it accepts connections it writes DIR/gateway.json (base_url, api_key, port, model,
pid); finished episodes go to DIR/episodes.jsonl. Serves the config's `init` policy
without running SFT, with its `gateway` section (the flags below override its fields).
SIGTERM or Ctrl-C stops it (exit 0). docs/harness.md has the contract.
"""

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from sao_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file[:variant].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for gateway.json and episodes.jsonl.")
# Overrides of the config's `gateway` section (sao_jax/defaults.py, the one source of the
# defaults; --config.gateway.<field>=... works too): None = the config's value.
_HOST = flags.DEFINE_string("host", None, "gateway.host: address to listen on (others warn).")
_PORT = flags.DEFINE_integer("port", None, "gateway.port: 0 picks a free one (see gateway.json).")
_MODEL = flags.DEFINE_string("model_name", None, "gateway.model_name: the served model's name.")
_REWARD_TIMEOUT = flags.DEFINE_float(
    "reward_timeout_s", None, "gateway.reward_timeout_s: episodes with no reward are ended."
)
_STRICT = flags.DEFINE_bool(
    "strict_sampling", None, "gateway.strict_sampling: refuse (400) other sampling knobs."
)
flags.mark_flags_as_required(["config", "workdir"])


@cli.guard
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)
    import logging
    import sys

    from sao_jax.config import validate
    from sao_jax.serve.launch import serve

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("sao_jax")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    config = _CONFIG.value
    flag_values = {"host": _HOST, "port": _PORT, "model_name": _MODEL,
                   "reward_timeout_s": _REWARD_TIMEOUT, "strict_sampling": _STRICT}  # fmt: skip
    for field, flag in flag_values.items():
        if flag.value is not None:
            config.gateway[field] = flag.value
    serve(validate(config), _WORKDIR.value)


def cli_main() -> None:
    """The `sao-serve` console script."""
    app.run(main, flags_parser=cli.parse_config_flags)


if __name__ == "__main__":
    cli_main()
