"""`specbench tune`: from "my pair, my prompts, my hardware, my load" to a configuration checked against a run."""
from specbench.tune.run import TuneResult, tune
from specbench.tune.spec import TuneSpec

__all__ = ["TuneResult", "TuneSpec", "tune"]
