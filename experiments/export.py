r"""Exports a run's policy as a Hugging Face Qwen3-MoE checkpoint with its tokenizer files.

  python -m experiments.export --workdir=workdirs/run --out=exports/run          # newest
  python -m experiments.export --workdir=workdirs/run --step=40 --out=exports/run_40

Writes config.json + model*.safetensors (per-expert layout, loadable by transformers'
Qwen3MoeForCausalLM and by sao_jax.models.hf.load_hf_policy), the run's tokenizer files
and sao_export.json (workdir, step), then prints which step it exported. Input errors (no
such workdir or step, a non-empty --out) print one line and exit 2.
"""

from absl import app, flags
from absl import logging as absl_logging

from sao_jax import cli, export

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory (config.json, checkpoints/).")
_OUT = flags.DEFINE_string("out", None, "An empty (or new) directory for the checkpoint.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the newest).")
_DTYPE = flags.DEFINE_enum(
    "dtype", None, ["float32", "bfloat16", "float16"], "Tensor dtype (default: the params')."
)
flags.mark_flags_as_required(["workdir", "out"])


@cli.guard
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax's info logs
    result = export.export_run(_WORKDIR.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value)
    tok = "with the tokenizer files" if result.tokenizer else "no Hugging Face tokenizer files"
    print(
        f"exported step {result.step} of {_WORKDIR.value} to {result.out} "
        f"({len(result.files)} files, {tok})"
    )


def cli_main() -> None:
    """The `sao-export` console script."""
    app.run(main)


if __name__ == "__main__":
    cli_main()
