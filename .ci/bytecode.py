"""Write the bytecode of what specbench runs, after an install that wrote none (`pip install --no-compile`).

pip compiles every file it installs, one at a time: on a 2-core box about 100 s of the 167 s the two installs took,
most of it for files nothing here imports (every model of transformers, sympy, plotly's validators). This imports what
the package, the notebooks' kernel, the servers and the tests import, in two processes, so Python writes the bytecode
of those modules alone: installs and this together 92-100 s, and imports afterwards as fast as after pip's compile,
also where PYTHONDONTWRITEBYTECODE is set. Anything else compiles when first imported.

    python .ci/bytecode.py            # the Makefile's set-up runs it
"""
import importlib
import os
import pkgutil
import subprocess
import sys
import time

GROUPS = {
    # the package and what loading and running a model reaches (the longer group: it starts first)
    "package": ["transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
                "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
                "transformers.convert_slow_tokenizer", "pyarrow.pandas_compat", "gguf", "torch._inductor.compile_fx"],
    # notebooks, servers, sweeps, tests and docs
    "tools": ["ipykernel.kernelapp", "jupyterlab.labapp", "nbclient", "papermill", "ray", "uvicorn", "pytest",
              "xdist", "nbmake", "mkdocs.commands.build", "selenium.webdriver"],
}


def import_group(group: str) -> None:
    names = list(GROUPS[group])
    if group == "package":
        import specbench

        names = [module.name for module in pkgutil.walk_packages(specbench.__path__, "specbench.")] + names
    started, failed = time.perf_counter(), []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001  (an extra not installed: it compiles when first imported)
            failed.append(f"{name} ({type(error).__name__}: {error})")
    print(f"bytecode: {group}: {len(sys.modules)} modules in {time.perf_counter() - started:.0f} s"
          + (f"; not importable here: {', '.join(failed)}" if failed else ""), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        import_group(sys.argv[1])
    else:
        env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
        children = [subprocess.Popen([sys.executable, __file__, group], env=env) for group in GROUPS]
        codes = [child.wait() for child in children]
        sys.exit(1 if any(codes) else 0)  # a child killed by a signal returns a negative code, which max() hid
