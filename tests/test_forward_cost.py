"""The worker's fitted forward cost and the batch wait it caps (`--batch-wait-ms auto`)."""
import random

import pytest

from specbench.types import SpecbenchError
from specbench.worker.forward_cost import ForwardCost
from specbench.worker.server import Worker, WorkerConfig


def test_the_fit_recovers_fixed_and_per_token_cost():
    cost, rng = ForwardCost(), random.Random(0)
    for n in range(64):
        assert n < 8 or cost.fit() is not None
        assert n >= 8 or cost.fit() is None  # too few batches to trust
        tokens = rng.randint(1, 40)
        cost.add(tokens, 0.3 + 0.02 * tokens + rng.uniform(-0.005, 0.005))
    fixed, per_token = cost.fit()
    assert fixed == pytest.approx(0.3, abs=0.01) and per_token == pytest.approx(0.02, abs=0.001)
    for _ in range(64):  # the window slides: a slower hardware's batches replace the old ones
        tokens = rng.randint(1, 40)
        cost.add(tokens, 0.1 + 0.05 * tokens)
    assert cost.fit() == pytest.approx((0.1, 0.05))


def test_no_fit_from_batches_of_one_size_and_the_fixed_part_is_clamped():
    cost = ForwardCost()
    for _ in range(20):
        cost.add(5, 0.2)
    assert cost.fit() is None and cost.fixed_s() == 0.0  # all one size: fixed and per token inseparable
    steep = ForwardCost()
    for tokens in range(1, 21):  # a line through a negative intercept: fixed clamped to 0
        steep.add(tokens, 0.01 * tokens - 0.005 if tokens > 1 else 0.006)
    assert steep.fit()[0] == 0.0
    cost.add(0, 1.0)  # an empty or failed forward is no sample
    assert len(cost.samples) == 20


def test_auto_waits_at_most_the_fitted_fixed_cost():
    worker = Worker(WorkerConfig(batch_wait_ms="auto"))
    assert worker.wait_cap_s() == 0.0  # nothing fitted yet: the window only
    for tokens in range(1, 33):
        worker.stats.forward.add(tokens, 0.25 + 0.01 * tokens)
    assert worker.wait_cap_s() == pytest.approx(0.25)
    assert Worker(WorkerConfig(batch_wait_ms="300")).wait_cap_s() == pytest.approx(0.3)
    with pytest.raises(SpecbenchError, match="--batch-wait-ms takes milliseconds or 'auto'"):
        Worker(WorkerConfig(batch_wait_ms="soon"))


def test_a_worker_fits_its_own_batches():
    """Every verify batch adds (its rows' tokens: each tree plus the last committed token, its seconds);
    `stats` reports the fit once batches of different sizes have run."""
    import numpy as np

    from conftest import PROMPTS
    from specbench.models.spec import ModelSpec
    from specbench.types import DraftTree
    from specbench.worker import protocol
    from specbench.worker.inbox import Message

    worker = Worker(WorkerConfig(model=ModelSpec("tiny-random:seed=0")), log=lambda line: None)

    def message(header, arrays=None):
        return Message(b"c", [], protocol.encode(dict({"client": "a-client-of-the-test"}, **header), arrays))

    committed = {}
    for name, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1]), ("c", PROMPTS[2])):
        header = {"op": "prefill", "session": name, "epoch": 1}
        assert protocol.decode(worker.handle(message(header, {"tokens": np.asarray(prompt, np.int32)}).frames))[0]["ok"]
        committed[name] = len(prompt)
    expected = []
    for step in range(12):
        names, width = ("a", "b", "c")[: 1 + step % 3], step % 4  # 1-3 rows, chains of 0-3 tokens
        batch = [message({"op": "verify", "session": name, "epoch": 1, "committed": committed[name], "seed": 0,
                          "sampling": {"temperature": 0.0}}, protocol.tree_to_arrays(DraftTree.chain([5] * width)))
                 for name in names]
        for name, (_, frames) in zip(names, worker.handle_many(batch)):
            reply = protocol.decode(frames)[0]
            assert reply["ok"], reply
            committed[name] = reply["committed"]
        expected.append(len(names) * (width + 1))
    assert [tokens for tokens, _ in worker.stats.forward.samples] == expected
    # each round's own work outside the forward, by its rows: what a prediction of a loaded worker adds
    assert [rows for rows, _ in worker.stats.host.samples] == [1 + step % 3 for step in range(12)]
    assert all(seconds > 0 for _, seconds in worker.stats.host.samples)
    stats = worker.ops.stats_op({}, {})[0]
    assert stats["forward_fixed_s"] >= 0 and stats["forward_token_s"] >= 0, stats
    assert stats["host_rounds"] == 12 and stats["host_fixed_s"] >= 0 and stats["host_row_s"] >= 0, stats
    assert stats["host_mean_s"] > 0
