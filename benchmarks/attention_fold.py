"""A GQA target's forward on a CPU with its few queries folded (`decode/packed_attention.sdpa`) or not.

For each dtype and cached context, a `LocalTarget` (its default path: the pooled cache) runs forwards of
n = 1, 2, 4, 8, 16 new tokens, the fold on and off alternately repeat by repeat (so drift on a shared box
hits both alike); the median of the faster half is kept. Off is transformers' own SDPA attention: for one
query its `enable_gqa` kernel, for more a copy of every key/value head per query head (`repeat_kv`).
Prints milliseconds, the speed-up, and what a verify of n tokens costs against a one-token step with
each (the ratio that decides how wide a draft pays); writes results/attention_fold.json.

    python benchmarks/attention_fold.py [--target smollm2-135m] [--dtypes bfloat16 float32]
                                        [--contexts 200 600 1500] [--repeats 12]
"""
from __future__ import annotations

import argparse
import statistics
import time

import pandas as pd

from specbench.decode import packed_attention
from specbench.decode.kv import cached_length, crop_to
from specbench.decode.target import LocalTarget
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec

from common import RESULTS, write_report

SIZES = (1, 2, 4, 8, 16)
FOLDED = packed_attention.FOLD  # the fold's bound as shipped; 0 turns it off


def timed(target: LocalTarget, state, past: int, count: int, fold: bool) -> float:
    """Milliseconds of one forward of `count` tokens over the session's cache (then cropped back)."""
    packed_attention.FOLD = FOLDED if fold else 0
    inputs = [5 + j for j in range(count)]
    start = time.perf_counter()
    target.forward(state, inputs, None, None)
    elapsed = time.perf_counter() - start
    crop_to(state.cache, past)
    return 1000 * elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[200, 600, 1500])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--out", default=str(RESULTS / "attention_fold.json"))
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes:
        target = LocalTarget(load_model(ModelSpec(args.target, dtype=dtype)))
        for context in args.contexts:
            target.prefill("s", [(i * 37) % 20000 + 100 for i in range(context)])
            state = target.state("s")
            past = cached_length(state.cache)
            for count in SIZES:  # warm both paths at every size
                timed(target, state, past, count, True), timed(target, state, past, count, False)
            for count in SIZES:
                times = {True: [], False: []}
                for repeat in range(args.repeats):
                    for fold in ((True, False) if repeat % 2 == 0 else (False, True)):
                        times[fold].append(timed(target, state, past, count, fold))
                kept = {fold: statistics.median(sorted(values)[:max(1, len(values) // 2)])
                        for fold, values in times.items()}
                rows.append({"dtype": dtype, "context": context, "tokens": count, "folded_ms": kept[True],
                             "transformers_ms": kept[False]})
            target.close("s")
    packed_attention.FOLD = FOLDED
    frame = pd.DataFrame(rows)
    frame["speed_up"] = frame.transformers_ms / frame.folded_ms
    one = frame[frame.tokens == 1].set_index(["dtype", "context"])
    for column, source in (("verify_over_step_folded", "folded_ms"), ("verify_over_step_transformers", "transformers_ms")):
        frame[column] = [getattr(row, source) / one.loc[(row.dtype, row.context), source] for row in frame.itertuples()]
    print(frame.round(2).to_string(index=False))
    write_report(args.out, {"target": args.target, "repeats": args.repeats, "rows": frame.to_dict("records")})


if __name__ == "__main__":
    main()
