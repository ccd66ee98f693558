"""`specbench serve`: an OpenAI-compatible endpoint over speculative decoding (see docs/serving.md)."""
from __future__ import annotations

from specbench.serve.settings import AUTO, Limits, RequestError, ServeSettings, Speculation

__all__ = ["Limits", "RequestError", "ServeSettings", "Speculation", "build_app"]


def build_app(settings: ServeSettings, log=print):
    """The FastAPI app of a server with these settings: its engine started (a worker in this process
    unless `settings.worker`), predictions read from the cache. `app.state.engine.close()` stops it."""
    from specbench.serve.app import create_app
    from specbench.serve.engine import Engine
    from specbench.serve.prediction import predicted_settings

    engine = Engine(settings, log=log)
    ks = range(1, settings.max_k + 1)
    priced = [name for name in settings.methods if name != AUTO]  # auto's choice is priced per request
    return create_app(engine, predicted_settings(settings.target, settings.draft, priced, ks, settings.dtype,
                                                 engine.target_device))
