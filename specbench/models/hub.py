"""Whether the Hugging Face hub can be reached from here, asked once: offline, an id that is not in the local cache
would otherwise wait out huggingface_hub's five retries (25 s) before saying so."""
from __future__ import annotations

import functools
import os
import socket
import threading
from urllib.parse import urlparse

RESOLVE_TIMEOUT_S = 3.0
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def hub_kwargs() -> dict:
    """`from_pretrained` / `snapshot_download` options: cache only when the hub's host does not resolve here."""
    return {} if hub_reachable() else {"local_files_only": True}


def offline_reason() -> str:
    """What a refusal says when the hub was not asked ("" when it was)."""
    if hub_reachable():
        return ""
    return (f"{hub_host()} cannot be reached from here (its name does not resolve, or HF_HUB_OFFLINE is set), "
            f"so only the local Hugging Face cache was searched")


def hub_host() -> str:
    from huggingface_hub import constants

    return urlparse(constants.ENDPOINT).hostname or "huggingface.co"


@functools.lru_cache(maxsize=1)
def hub_reachable() -> bool:
    """False when HF_HUB_OFFLINE is set or the hub's host name does not resolve within a few seconds (a DNS
    lookup, no request); True otherwise (and behind an HTTPS proxy, which resolves names itself), so a machine
    with the hub behaves as huggingface_hub does alone."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    if any(os.environ.get(name) for name in PROXY_VARIABLES):  # the proxy resolves the hub's name, not this machine
        return True
    found: list[bool] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(hub_host(), 443)
            found.append(True)
        except OSError:
            found.append(False)

    thread = threading.Thread(target=resolve, daemon=True)
    thread.start()
    thread.join(RESOLVE_TIMEOUT_S)
    return bool(found and found[0])
