"""The sweep's results: the table of its trials, and the best complete trial as best.json (with the
command that trained it)."""
from __future__ import annotations

import json
from pathlib import Path

from meshtrain.core.folders import full_disk_is_user_error, replace_file
from meshtrain.sweep.folder import shown_path
from meshtrain.sweep.space import param_sets, train_args
from meshtrain.sweep.study import shown_url


def table(trials) -> str:
    replaced_by = {n: t.number for t in trials for n in t.system_attrs.get("retry_history", [])[-1:]}
    keys = sorted({k for t in trials for k in t.params})
    rows = [["trial", "state", "eval_loss", "step", *keys, "run", "note"]]
    for t in sorted(trials, key=lambda t: t.number):
        step = max(t.intermediate_values, default=None)
        value = t.value if t.value is not None else t.intermediate_values.get(step)
        note = t.user_attrs.get("error", "")
        if t.number in replaced_by:
            note = f"retried as trial {replaced_by[t.number]}"
        elif "failed_trial" in t.system_attrs:
            note = f"retry of trial {t.system_attrs['failed_trial']}"
        rows.append([str(t.number), t.state.name, "-" if value is None else f"{value:.4f}",
                     "-" if step is None else str(step), *(_short(t.params.get(k, "-")) for k in keys),
                     shown_path(t.user_attrs["run_dir"]) if "run_dir" in t.user_attrs else "-", note])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows)


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def best_record(study, url: str, config: str | None, sets: list[str]) -> dict | None:
    import optuna

    done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    if not done:
        return None
    best = min(done, key=lambda t: (t.value, t.number))
    run = best.user_attrs["run_dir"]
    command = ["python", "-m", "meshtrain.train", *train_args(config, [*sets, *param_sets(best.params)], run)]
    return {"study": study.study_name, "storage": shown_url(url), "trial": best.number, "eval_loss": best.value,
            "step": max(best.intermediate_values, default=None), "params": best.params, "run": run,
            "command": " ".join(command)}


def write_best(path: Path, best: dict) -> None:
    """best.json, whole or as it was."""
    with full_disk_is_user_error(path, "best.json", then="rerun the same command (it reruns no trial)"):
        replace_file(path, json.dumps(best, indent=2) + "\n")

