"""A Ray cluster to work on, for a block: `ray_launch` (training processes) and `data prepare --ray`
(tokenizing tasks) both connect through `connected`."""
import contextlib

from meshtrain.core.errors import UserError


@contextlib.contextmanager
def connected(address: str, flag: str = "--address", local: dict | None = None, **init):
    """Connected to the Ray cluster at `address` for the block: `local` starts one on this machine
    (`local`: ray.init's arguments for that, e.g. num_cpus), anything else is ray.init's address (auto:
    the running cluster); `init`: ray.init's other arguments. A process already connected (a notebook,
    a test's cluster) stays as it is. `flag` names the address in errors."""
    import ray

    if ray.is_initialized():
        yield
        return
    if address == "local":
        ray.init(include_dashboard=False, **(local or {}), **init)
    else:
        try:
            ray.init(address=address, **init)
        except ConnectionError as e:
            raise UserError(f"no Ray cluster at {flag} {address} ({str(e).splitlines()[0]}); start one "
                            f"with ray start --head, or pass {flag} local") from None
        except ValueError as e:  # Ray's parse of the address: "Invalid address format"
            raise UserError(f"{flag} {address!r} is not a Ray address ({str(e).splitlines()[0]}); pass auto, "
                            f"local, HOST:PORT or ray://HOST:PORT") from None
    try:
        yield
    finally:
        ray.shutdown()
