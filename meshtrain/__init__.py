"""meshtrain: train transformer language models on a named device mesh with JAX SPMD."""
import importlib
import sys

if sys.argv[:1] == ["-m"]:  # `python -m meshtrain.<command>` is starting: a Ctrl-C now is one line too
    from meshtrain.core.exits import take_signals

    take_signals()  # first: a signal during the imports below ends the command with its line
    from meshtrain.core.cli import import_jax_without_driver_probe, interrupt_exits_quietly

    interrupt_exits_quietly()
    import_jax_without_driver_probe()
elif "jax" not in sys.modules:  # a script or notebook: no CUDA version-check traceback where no driver loads
    from meshtrain.core.cli import skip_cuda_check

    skip_cuda_check()

__all__ = ["Config", "UserError", "load_config", "Trainer", "TrainProgram", "simulate_cpu_devices"]

_WHERE = {"Config": "meshtrain.config.loader", "UserError": "meshtrain.core.errors",
          "load_config": "meshtrain.config.loader", "Trainer": "meshtrain.run.trainer",
          "TrainProgram": "meshtrain.engine.program", "simulate_cpu_devices": "meshtrain.core.cli"}


def __getattr__(name):
    """Import on first use, so `import meshtrain` is light and --devices can act before JAX starts."""
    if name not in _WHERE:
        raise AttributeError(name)
    return getattr(importlib.import_module(_WHERE[name]), name)
