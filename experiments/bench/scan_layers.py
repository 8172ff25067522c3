"""`model.scan_layers` at demo scale: per-layer loop vs stacked, scanned layers, side by side.

    python -m experiments.bench.scan_layers                 # 8 timed repeats of each
    python -m experiments.bench.scan_layers --repeats 3
    python -m experiments.bench.scan_layers --depths 3,24,48   # decode compile vs depth only
    python -m experiments.bench.scan_layers --cache-len 4096   # decode cost by span only
    python -m experiments.bench.scan_layers --attention naive blockwise:32 blockwise:64

On configs/sao.py (the README's demo: the tiny model, rl.batch_size rows of length
sampling.max_len, the sampler's slots, cache length and steps per sync) with the random
init, in one process, interleaved (False, True, False, True, ...):

1. the update step (`Learner.update_step`, SAO's demo config) on one synthetic batch of
   the demo's shape: compile (process CPU seconds of the first call) and the median
   process CPU and wall seconds of the timed calls;
2. the sampler's decode step (`GenerateFns.decode`, one call = steps_per_sync tokens per
   slot, every slot at position max_len / 2) and the prefill of a 16-token chunk: lower +
   compile CPU seconds and the median process CPU / wall seconds per call.

With --depths, only the lower + compile CPU seconds of the decode step (the demo's
model at each depth, both layouts) are printed: the stacked decode is one layer body per
stack, so its compile time should not grow with depth. With --cache-len L, only a decode call at
position 64 reading span 128 vs one at L/2 reading the whole cache, both layouts: the
stacked cache must keep the decode cost proportional to the span read. With --attention
IMPL[:BLOCK] ..., only the demo's update step (scan_layers False) with each training
attention (`model.attention_impl`, `model.attention_block`), interleaved: compile CPU s and
the median process CPU s per step, with the ratio to the first one.

Process CPU time counts every thread of this process, so other processes' load changes
it less than wall time; both are printed, with the load average.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from configs import sao
from sao_jax import config as config_lib
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.parallel.mesh import Sharder
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.rl.update import Learner
from sao_jax.sampling.generate import GenerateFns, SamplingParams, Spans
from sao_jax.sampling.sampler import configs_from_section


def _timed(fn):
    """(result, process CPU s, wall s) of fn() run to completion."""
    c, w = time.process_time(), time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.process_time() - c, time.perf_counter() - w


class Variant:
    """One scan_layers setting: its learner state, batch, decode and prefill programs."""

    def __init__(self, scan: bool, cache_len: int = 0, **model):
        c = sao.get_config()
        c.model.update(model, scan_layers=scan)
        c.sampling.max_len = cache_len or c.sampling.max_len
        self.config = config = config_lib.validate(c)
        models = init_models(ModelConfig.from_config(config.model), Sharder(), config.seed)
        self.learner = Learner(
            config.rl, config.optim, models.policy_def, models.critic_def, Sharder()
        )
        self.state = self.learner.new_state(models.policy, models.critic, seed=0)
        ecfg, _ = configs_from_section(config.sampling, config.seed)
        self.s, self.max_len = ecfg.num_slots, ecfg.max_len
        self.batch = synthetic_batch(
            config.rl.batch_size, self.max_len, config.model.vocab_size, seed=0
        )
        self.fns = GenerateFns(
            models.policy_def,
            num_slots=self.s,
            max_len=self.max_len,
            steps=ecfg.steps_per_sync,
            record_routing=ecfg.record_routing,
        )
        self.params = models.policy
        self.cache = self.fns.init_cache(self.params)
        self.sampling = SamplingParams(1.0, ecfg.top_k, ecfg.top_p)
        self.tokens = jnp.zeros((self.s,), jnp.int32)
        self.positions = jnp.full((self.s,), self.max_len // 2, jnp.int32)
        self.chunk = jnp.zeros((self.s, 16), jnp.int32)
        self.chunk_pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (self.s, 16))

    def update(self, i: int):
        self.state, m = self.learner.update_step(self.state, self.batch, jax.random.key(i))
        return m

    def decode(self, i: int, spans: Spans | None = None):
        self.cache, out = self.fns.decode(
            self.params,
            self.cache,
            self.tokens,
            self.positions,
            jax.random.key(i),
            self.sampling,
            spans,
        )
        return out

    def prefill(self, i: int):
        self.cache, _ = self.fns.prefill(self.params, self.cache, self.chunk, self.chunk_pos)
        return self.cache

    def compile_seconds(self) -> dict[str, float]:
        """Lower + compile CPU seconds of the decode and prefill programs (fresh traces)."""
        f = self.fns
        i32 = jnp.zeros((self.s,), jnp.int32)
        out = {}
        args = (self.params, self.cache, i32, i32, jax.random.key(0), *self.sampling.arrays(), None)
        c = time.process_time()
        f._decode.lower(*args, span=self.max_len, lane_span=None).compile()
        out["decode"] = time.process_time() - c
        args = (self.params, self.cache, self.chunk, self.chunk_pos, None)
        c = time.process_time()
        f._prefill.lower(*args, span=self.max_len, lane_span=None).compile()
        out["prefill"] = time.process_time() - c
        return out


def _row(name, times: dict, first: dict | None = None) -> str:
    cpu = {k: statistics.median(c for c, _ in v) for k, v in times.items()}
    wall = {k: statistics.median(w for _, w in v) for k, v in times.items()}
    cells = [f"{cpu[k]:.3f} / {wall[k]:.3f}" for k in (False, True)]
    ratio = cpu[True] / cpu[False]
    pairs = sorted(t / f for (t, _), (f, _) in zip(times[True], times[False], strict=True))
    spread = f"{ratio:.2f}x ({pairs[0]:.2f}-{pairs[-1]:.2f})"  # range of the paired repeats
    comp = "" if first is None else f" | {first[False]:.1f} / {first[True]:.1f}"
    return f"| {name} | {cells[0]} | {cells[1]} | {spread}{comp} |"


def span_costs(args) -> None:
    """Decode call at position 64 reading span 128 vs at position L/2 reading the whole
    cache of length L = --cache-len, both layouts, interleaved (median CPU s per call)."""
    n, big = args.decode_calls, args.cache_len // 2
    variants = {scan: Variant(scan, cache_len=args.cache_len) for scan in (False, True)}
    cases = {"pos 64, span 128": (64, Spans(128)), f"pos {big}, whole cache": (big, None)}
    times = {(scan, c): [] for scan in variants for c in cases}
    for r in range(args.repeats + 1):
        for scan, x in variants.items():
            for case, (pos, spans) in cases.items():
                x.positions = jnp.full((x.s,), pos, jnp.int32)
                fn = lambda x=x, r=r, spans=spans: [x.decode(r * n + i, spans) for i in range(n)]
                _, c, _ = _timed(lambda fn=fn: fn()[-1])
                if r:
                    times[scan, case].append(c / n)
    print(f"# load average at end: {os.getloadavg()}; cache length {args.cache_len}")
    print("| decode call | False: CPU ms | True: CPU ms | True/False |")
    print("|---|---:|---:|---:|")
    med = {k: statistics.median(v) for k, v in times.items()}
    for c in cases:
        print(f"| {c} | {med[False, c] * 1e3:.2f} | {med[True, c] * 1e3:.2f} | "
              f"{med[True, c] / med[False, c]:.2f}x |")  # fmt: skip
    short, whole = cases
    for scan in variants:
        print(f"scan_layers={scan}: {short} / {whole} = {med[scan, short] / med[scan, whole]:.2f}")


def attention_costs(args) -> None:
    """The demo's update step with each --attention IMPL[:BLOCK], interleaved."""
    variants = {}
    for spec in args.attention:
        impl, _, block = spec.partition(":")
        kw = {"attention_impl": impl} | ({"attention_block": int(block)} if block else {})
        variants[spec] = Variant(False, **kw)
    first, times = {}, {k: [] for k in variants}
    for r in range(args.repeats + 1):  # call 0 compiles
        for k, x in variants.items():
            _, c, _ = _timed(lambda x=x, r=r: x.update(r))
            if r:
                times[k].append(c)
            else:
                first[k] = c
    print(f"# load average at end: {os.getloadavg()}")
    print("| training attention | update step CPU s (median) | vs first | compile CPU s |")
    print("|---|---:|---:|---:|")
    base = statistics.median(times[args.attention[0]])
    for k, v in times.items():
        med = statistics.median(v)
        print(f"| {k} | {med:.3f} | {med / base:.2f}x | {first[k]:.1f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=8, help="timed calls per variant and program")
    p.add_argument("--decode-calls", type=int, default=20, help="decode calls per timed repeat")
    p.add_argument("--cache-len", type=int, default=0, help="e.g. 4096: decode cost by span only")
    p.add_argument("--depths", default="", help="e.g. 3,48: decode compile time vs depth only")
    p.add_argument("--attention", nargs="*", default=[], help="IMPL[:BLOCK]: update step only")
    args = p.parse_args(argv)
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {platform.node()}  {platform.machine()}")
    print(f"# jax {jax.__version__} backend={jax.default_backend()} devices={jax.device_count()}")
    print(f"# load average at start: {os.getloadavg()}")
    if args.depths:
        print("| layers | decode lower + compile CPU s, False | True |")
        print("|---:|---:|---:|")
        for n in map(int, args.depths.split(",")):
            c = [Variant(s, num_hidden_layers=n).compile_seconds()["decode"] for s in (False, True)]
            print(f"| {n} | {c[0]:.1f} | {c[1]:.1f} |")
        return
    if args.cache_len:
        return span_costs(args)
    if args.attention:
        return attention_costs(args)
    variants = {scan: Variant(scan) for scan in (False, True)}
    v = variants[False]
    print(
        f"# configs/sao.py: {v.config.model.num_hidden_layers} layers, update batch "
        f"{v.config.rl.batch_size} x {v.max_len}; sampler {v.s} slots x {v.max_len}, "
        f"{v.fns.steps} token(s) per decode call"
    )
    compiles = {k: x.compile_seconds() for k, x in variants.items()}
    first, times = {}, {k: {False: [], True: []} for k in ("update", "decode", "prefill")}
    for r in range(args.repeats + 1):  # call 0 compiles (update) / warms up
        for scan, x in variants.items():
            _, c, w = _timed(lambda x=x, r=r: x.update(r))
            if r == 0:
                first[scan] = c
            else:
                times["update"][scan].append((c, w))
            for prog, n in (("decode", args.decode_calls), ("prefill", args.decode_calls)):
                fn = getattr(x, prog)
                _, c, w = _timed(lambda fn=fn, n=n, r=r: [fn(r * n + i) for i in range(n)][-1])
                if r:
                    times[prog][scan].append((c / n, w / n))
    print(f"# load average at end: {os.getloadavg()}")
    head = "False: CPU / wall s | True: CPU / wall s | CPU True/False (range) | compile CPU s"
    print(f"| program | {head} |")
    print("|---|---|---|---|---|")
    print(_row("update step", times["update"], first))
    for prog in ("decode", "prefill"):
        comp = {k: compiles[k][prog] for k in (False, True)}
        print(_row(f"{prog} call", times[prog], comp))
    leaves = {k: len(jax.tree.leaves(x.state)) for k, x in variants.items()}
    print(f"TrainState leaves: {leaves[False]} (False) vs {leaves[True]} (True)")


if __name__ == "__main__":
    main()
