"""A worker shared by many clients batches their verifies, and every client gets what it gets alone."""
import threading

import pytest

from specbench.api import outputs, run
from specbench.types import SamplingParams
from specbench.worker.client import RemoteTarget

from conftest import PROMPTS
from worker_helpers import process_worker

PROMPT_SET = [PROMPTS[i % len(PROMPTS)][: 4 + i] for i in range(6)]


def clients_in_parallel(endpoint, draft, sampling, methods):
    """Six clients, each with its own RemoteTarget and prompt, all decoding at once."""
    results, errors = {}, []

    def client(index):
        try:
            remote = RemoteTarget(endpoint)
            results[index] = run(remote, [PROMPT_SET[index]], method=methods, draft=draft, k=3, max_new_tokens=20,
                                 sampling=sampling, seed=index, progress=False, warmup=False)
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPT_SET))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not errors, errors
    return results


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, rule="rejection")],
                         ids=["greedy", "rejection"])
@pytest.mark.parametrize("batching", [True, False], ids=["batched", "one-at-a-time"])
def test_concurrent_clients_get_what_they_get_alone(tiny_target, tiny_draft, sampling, batching):
    methods = ["target-only", "chain", "fixed-tree"] if sampling.greedy else ["target-only", "chain"]
    with process_worker(*([] if batching else ["--no-batching"])) as worker:
        results = clients_in_parallel(worker.endpoint, tiny_draft, sampling, methods)
        assert RemoteTarget(worker.endpoint).info["packed_batches"]  # what `replay_speed` prices them as
    sizes = []
    for index, records in results.items():
        alone = run(tiny_target, [PROMPT_SET[index]], method=methods, draft=tiny_draft, k=3, max_new_tokens=20,
                    sampling=sampling, seed=index, progress=False, warmup=False)
        assert outputs(records) == outputs(alone), index
        sizes += list(records["batch_size"])
    if batching:
        assert max(sizes) > 1, "no two verifies ever shared a forward: the test proves nothing"
    else:
        assert set(sizes) == {1}


def test_a_fast_worker_batches_its_clients_verifies(tiny_target, tiny_draft):
    """`--fast`: the clients' verifies share fixed-shape forwards over the static pool (batch sizes > 1),
    and each client gets what it gets alone on an eager target."""
    methods = ["target-only", "chain", "fixed-tree"]
    with process_worker("--fast", "static") as worker:
        results = clients_in_parallel(worker.endpoint, tiny_draft, SamplingParams(), methods)
        info = RemoteTarget(worker.endpoint).info
    assert info["kv_pool"]["slots"] >= 1 and not info["packed_batches"]  # padded to a bucket, priced so
    assert info["fast"]["backend"] == "static" and info["fast"]["batched"] > 0  # verifies shared a forward
    sizes = []
    for index, records in results.items():
        alone = run(tiny_target, [PROMPT_SET[index]], method=methods, draft=tiny_draft, k=3, max_new_tokens=20,
                    progress=False, warmup=False)
        assert outputs(records) == outputs(alone), index
        sizes += list(records["batch_size"])
    assert max(sizes) > 1, "no two verifies ever shared a forward: the test proves nothing"
