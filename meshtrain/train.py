"""`python -m meshtrain.train`: parse flags, build a Trainer, run. All logic lives in importable modules."""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

from meshtrain.config.loader import (
    MAX_SIMULATED_DEVICES,
    UserError,
    commented_yaml,
    load_config,
    reference_markdown,
    split_override,
)
from meshtrain.core import exits
from meshtrain.core.cli import (
    Parser,
    arguments,
    command,
    compile_cache_flag,
    devices_flag,
    number,
    raise_interrupt,
    simulate_devices,
)

# Shortcut flags -> config keys.
FLAG_KEYS = {"mesh": "parallel.mesh", "devices": "devices", "steps": "train.steps", "batch_size": "train.batch_size",
             "seq_len": "train.seq_len", "data": "data.path", "text_field": "data.text_field", "out": "out",
             "resume": "checkpoint.resume", "init_from": "checkpoint.init_from", "profile": "logging.profile",
             "compile_cache": "compile_cache"}


def parser() -> Parser:
    p = Parser(prog="python -m meshtrain.train", description="Train a transformer on a named mesh.")
    p.add_argument("--config", help="YAML config (see configs/ and docs/config.md)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value by dotted path, e.g. --set model.num_layers=8 (repeatable)")
    p.add_argument("--mesh", help="'8x8x4' (data x fsdp x tensor [x pipeline]) or 'data=2,fsdp=4'; -1 = the rest")
    devices_flag(p, f"simulate this many CPU devices (1 to {MAX_SIMULATED_DEVICES}) when no accelerator is present",
                 type=int)  # the range is checked with the config key's message (`overrides`)
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int, help="global batch size in sequences")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--data", help="text file or folder, .jsonl, Parquet, datasets save_to_disk folder, .bin token "
                                  "file, or a prepared folder (python -m meshtrain.data prepare)")
    p.add_argument("--text-field", help="the jsonl field / Parquet or datasets column holding the text "
                                        "(data.text_field, default text)")
    p.add_argument("--out", help="output folder for config.yaml, metrics.jsonl, tensorboard/ and checkpoints/ "
                                 "(default runs/<config file name>)")
    p.add_argument("--resume", help="auto (default: latest checkpoint under --out), never, or a checkpoint path")
    p.add_argument("--allow-change", action="store_true",
                   help="continue the run in --out although this start changes what defines it (its data, seed, "
                        "schedule horizon or model; recorded in <out>/run.json as a new phase)")
    p.add_argument("--init-from", help="start from these weights when there is no checkpoint to resume: "
                                       "hf:DIR (a Hugging Face checkpoint) or a meshtrain run folder")
    p.add_argument("--profile", metavar="START:STOP",
                   help="trace steps START to STOP (as logged, both included) with jax.profiler into <out>/profile "
                        "(TensorBoard's profile plugin, Perfetto)")
    compile_cache_flag(p)
    p.add_argument("--print-config", action="store_true", help="print the resolved config with comments and exit")
    p.add_argument("--config-reference", action="store_true",
                   help="print every config key, its default and meaning (docs/config.md) and exit")
    p.add_argument("--coordinator", help="multi-host: coordinator host:port (else SLURM/Open MPI/K8s env)")
    p.add_argument("--num-processes", type=number(int, min=1))
    p.add_argument("--process-id", type=number(int, min=0), help="0 to --num-processes - 1")
    p.add_argument("--heartbeat-timeout", type=number(int, min=1), default=100, metavar="SECONDS",
                   help="multi-host: when a process dies, the others stop with an error after this long")
    p.add_argument("--init-timeout", type=number(int, min=1), default=300, metavar="SECONDS",
                   help="multi-host: how long to wait for every process to join")
    return p


def overrides(args) -> list[str]:
    """--set items, then the shortcut flags; a flag and a --set of the same key must not both be given."""
    set_keys = {split_override(item)[0]: item for item in args.set}
    flags = []
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if key in set_keys:
            raise UserError(f"--{flag.replace('_', '-')} {value} and --set {set_keys[key]} both set {key}; "
                            f"pass only one")
        flags.append(f"{key}={value}")
    if args.devices is not None and not 1 <= args.devices <= MAX_SIMULATED_DEVICES:
        raise UserError(f"--devices {args.devices}: simulate 1 to {MAX_SIMULATED_DEVICES} CPU devices, "
                        f"or omit --devices to use the machine's own")
    if args.data is not None and "data.kind" not in set_keys:
        flags.append("data.kind=auto")  # --data means: train on this path (unless data.kind is given)
    return list(args.set) + flags


@command
def main(argv=None) -> int:
    """Ctrl-C during training saves a checkpoint and returns 0 (Trainer.fit); before it, the
    wrapper's one line and 130: nothing was written yet."""
    args = arguments(parser(), argv)
    if args.config_reference:
        print(reference_markdown(), end="")
        return 0
    with noting_interrupts() as interrupted:
        cfg = load_config(args.config, overrides(args))
        if args.print_config:
            print(commented_yaml(cfg), end="")
            return 0
        run(cfg, args, interrupted)
    return 0


def run(cfg, args, interrupted: threading.Event) -> None:
    from meshtrain.run import multihost

    simulate_devices(cfg.devices)  # --devices, or the config's devices key
    multihost.init_distributed(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout,
                               args.init_timeout)
    from meshtrain.run.trainer import Trainer

    try:
        interrupted.trainer = trainer = Trainer(cfg, allow_change=args.allow_change)
        if interrupted.is_set():  # a Ctrl-C or SIGTERM that a library callback swallowed while starting up
            raise_interrupt(interrupted.signum, None)
        trainer.fit()
        exits.done(0)  # trained and saved: a signal while the processes leave together exits 0 at once
    except Exception as e:  # noqa: BLE001 - a peer that died is named in one line, not a traceback
        multihost.wait_if_a_peer_died(e, args.heartbeat_timeout)
        raise
    finally:
        multihost.run_over()
    multihost.leave_together()


@contextlib.contextmanager
def noting_interrupts():
    """Ctrl-C raises KeyboardInterrupt and SIGTERM `Terminated` (`cli.raise_interrupt`: after JAX's GC
    hook returns, where it would be swallowed); either is also remembered, so the run stops before it
    writes."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def on_signal(signum, frame):
        interrupted.signum = signum
        interrupted.set()
        if getattr(getattr(interrupted, "trainer", None), "fitted", False):
            exits.done(0)  # fit() returned (trained, saved): the signal ends a finished run, exit 0
        raise_interrupt(signum, frame)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield interrupted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
