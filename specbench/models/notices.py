"""Library messages that tell a specbench user nothing, switched off where specbench says it better."""
from __future__ import annotations

import contextlib


def quiet_library_notices() -> None:
    """For command-line runs: transformers' per-load progress bars and notices tell a specbench user
    nothing (specbench shows one bar per phase and says what it loads), so they are switched off."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@contextlib.contextmanager
def quiet_transformers():
    """transformers' own bars and notices, off: inside our one bar per phase they nest three deep,
    and its GGUF notice (packed weights are fastest in float32) is moot, since we dequantize once."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def plain_warnings() -> None:
    """For command-line runs: specbench's own warnings print as one line, `specbench: warning: ...`, as its errors
    do; the source line Python adds names specbench's code, which tells a command-line user nothing. Other
    libraries' warnings keep Python's form."""
    import warnings
    from pathlib import Path

    package, default = str(Path(__file__).resolve().parents[1]), warnings.formatwarning

    def formatted(message, category, filename, lineno, line=None):
        if issubclass(category, UserWarning) and str(Path(filename).resolve()).startswith(package):
            return f"specbench: warning: {message}\n"
        return default(message, category, filename, lineno, line)

    warnings.formatwarning = formatted
