"""meshtrain: train transformer language models on a named device mesh with JAX SPMD."""
from meshtrain.config import Config, UserError, load_config

__all__ = ["Config", "UserError", "load_config", "Trainer", "simulate_cpu_devices"]


def __getattr__(name):  # import JAX-heavy modules lazily, so --devices can act before JAX starts
    if name == "Trainer":
        from meshtrain.trainer import Trainer
        return Trainer
    if name == "simulate_cpu_devices":
        from meshtrain.mesh import simulate_cpu_devices
        return simulate_cpu_devices
    raise AttributeError(name)
