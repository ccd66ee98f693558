"""Library messages that tell a specbench user nothing, switched off where specbench says it better."""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path


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
    libraries' warnings keep the form they had. Called again (`main` runs many times in the tests' process), it
    leaves the one it set."""
    global _other_form
    if warnings.formatwarning is not _one_line:
        _other_form, warnings.formatwarning = warnings.formatwarning, _one_line


_PACKAGE = str(Path(__file__).resolve().parents[1])
_other_form = warnings.formatwarning  # what `plain_warnings` replaced: the form of every other warning


def _one_line(message, category, filename, lineno, line=None):
    if issubclass(category, UserWarning) and str(Path(filename).resolve()).startswith(_PACKAGE):
        return f"specbench: warning: {message}\n"
    return _other_form(message, category, filename, lineno, line)
