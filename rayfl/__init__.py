"""rayfl: Ray-powered simulation of model-heterogeneous personalized federated learning.

The Python API (docs/api.md) mirrors the commands:

    import rayfl
    result = rayfl.run("experiments/pfedes_fmnist.yaml", engine__rounds=2)   # rayfl run
    table = rayfl.suite("experiments/suites/seed3_fmnist.yaml", seeds=[0])    # rayfl compare
    best = rayfl.sweep("experiments/sweeps/pfedes_T_alpha.yaml")             # rayfl tune

`rayfl.compare` and `rayfl.tune` are the modules behind the last two commands.
"""

from rayfl.api import RunResult, SuiteResult, run, suite, sweep
from rayfl.errors import ConfigError, UserError
from rayfl.version import __version__

__all__ = [
    "ConfigError",
    "RunResult",
    "SuiteResult",
    "UserError",
    "run",
    "suite",
    "sweep",
    "__version__",
]
