"""Where the Hugging Face hub is out of reach, a hub id is looked up in the local cache only and refused at once,
naming why, instead of after huggingface_hub's five retries (25 s here)."""
import pytest

from specbench.models import hub
from specbench.models.loading import load_model, load_tokenizer
from specbench.models.spec import ModelSpec
from specbench.types import SpecbenchError


@pytest.fixture
def host(monkeypatch):
    """Point the check at a host name of the test's choosing, asked afresh."""
    for name in ("HF_HUB_OFFLINE", *hub.PROXY_VARIABLES):
        monkeypatch.delenv(name, raising=False)

    def use(name):
        monkeypatch.setattr(hub, "hub_host", lambda: name)
        hub.hub_reachable.cache_clear()

    yield use
    hub.hub_reachable.cache_clear()


def test_a_host_that_resolves_leaves_huggingface_hub_alone(host):
    host("localhost")
    assert hub.hub_reachable() and hub.hub_kwargs() == {} and hub.offline_reason() == ""


def test_a_host_that_does_not_resolve_means_the_cache_only(host):
    host("no-such-host.invalid")  # .invalid never resolves (RFC 2606)
    assert not hub.hub_reachable() and hub.hub_kwargs() == {"local_files_only": True}
    with pytest.raises(SpecbenchError, match="could not load 'someone/not-cached-here'.*no-such-host.invalid cannot "
                                             "be reached from here.*only the local Hugging Face cache"):
        load_model(ModelSpec("someone/not-cached-here"))
    with pytest.raises(OSError):  # the tokenizer alone is looked up the same way
        load_tokenizer("someone/not-cached-here")
    from specbench.heads.layouts import load_head

    with pytest.raises(SpecbenchError, match="draft head 'someone/no-head'.*cannot be reached from here"):
        load_head("someone/no-head", None)


def test_hf_hub_offline_is_honoured_without_a_lookup(host, monkeypatch):
    host("localhost")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.hub_reachable.cache_clear()
    assert not hub.hub_reachable()


def test_behind_a_proxy_the_hub_is_asked_whatever_this_machine_resolves(host, monkeypatch):
    host("no-such-host.invalid")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    hub.hub_reachable.cache_clear()
    assert hub.hub_reachable() and hub.hub_kwargs() == {}
