"""Train from Python (a script or a notebook) on 8 simulated CPU devices.

    python examples/quickstart.py

On a GPU host drop `devices`: the mesh then spans the real accelerators.
"""
import meshtrain

meshtrain.simulate_cpu_devices(8)  # before anything touches JAX's devices

cfg = meshtrain.load_config("configs/shakespeare_char.yaml", [
    "parallel.mesh=data=2,fsdp=2,tensor=2",  # 8 devices: 2-way data x 2-way FSDP x 2-way tensor parallel
    "parallel.zero=1",                       # also shard Adam's moments over the data axis
    "train.steps=200",
    "train.log_every=25",
    "out=runs/quickstart",          # rerun: resumes from the newest checkpoint there (checkpoint.resume=auto)
])
history = meshtrain.Trainer(cfg).fit()

train = [r for r in history if "loss" in r]
if train:
    print(f"loss {train[0]['loss']:.3f} -> {train[-1]['loss']:.3f} over steps {train[0]['step']}-{train[-1]['step']}")
else:
    print(f"{cfg.out} already holds the trained run; delete it to train again, or raise train.steps")
