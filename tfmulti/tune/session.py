"""A tuning session's results: the table (printed and trials.csv), the plot (accuracy.png:
the objective, a validation figure, against the learning rate used, one colour per global
batch) and best.cfg, the best trial's flagfile that `python -m tfmulti.main --flagfile=...`
runs as is: on all the training data, reporting the test figures the session never saw."""
import csv
import dataclasses
import os

from tfmulti.distribution import storage
from tfmulti.errors import UserError
from tfmulti.models.usermodel import SCOPE
from tfmulti.tune.trial import trial_history


def trial_rows(tuner):
    """A row per trial: tfmulti's settings, your model's hyperparameters (as keras-tuner
    names them, model/NAME, apart from tfmulti's), the objective and the time."""
    objective = tuner.oracle.objective.name
    trials = sorted(tuner.oracle.trials.values(), key=lambda t: t.trial_id)
    yours = sorted({n for t in trials for n in t.hyperparameters.values
                    if n.startswith(SCOPE + "/")})
    rows = []
    for trial in trials:
        values = trial.hyperparameters.values
        metric = lambda name: (trial.metrics.get_last_value(name)  # noqa: E731
                               if trial.metrics.exists(name) else None)
        pruned = metric("pruned")
        rows.append({"trial": trial.trial_id,
                     "status": f"PRUNED@{pruned:.0f}" if pruned else str(trial.status),
                     "per_replica_batch_size": values.get("per_replica_batch_size"),
                     "global_batch_size": metric("global_batch_size"),
                     "base_lr": values.get("base_lr"), "lr_scaling": values.get("lr_scaling"),
                     "warmup_epochs": values.get("warmup_epochs"),
                     "lr_schedule": values.get("lr_schedule"), "momentum": values.get("momentum"),
                     "weight_decay": values.get("weight_decay"),
                     "learning_rate": metric("learning_rate"),
                     **{name: values.get(name) for name in yours},
                     objective: metric(objective), "seconds": metric("seconds")})
    return rows


def write_table(rows, path):
    with storage.replacing(path, "w") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def format_table(rows, objective):
    def show(value, fmt):
        if value is None:
            return "-"
        return format(value, fmt) if isinstance(value, (int, float)) else str(value)

    yours = [n for n in rows[0] if n.startswith(SCOPE + "/")]
    widths = {n: max(len(n), 6) for n in [*yours, objective]}
    lines = [f"{'trial':>5} {'status':>9} {'batch':>6} {'base_lr':>8} {'rule':>6} "
             f"{'warm-up':>7} {'lr':>8} "
             + "".join(f"{n:>{widths[n]}} " for n in [*yours, objective]) + f"{'time s':>7}"]
    for r in rows:
        lines.append(f"{r['trial']:>5} {r['status']:>9} {show(r['global_batch_size'], '.0f'):>6} "
                     f"{show(r['base_lr'], '.4f'):>8} {str(r['lr_scaling']):>6} "
                     f"{show(r['warmup_epochs'], '.1f'):>7} {show(r['learning_rate'], '.4f'):>8} "
                     + "".join(f"{show(r[n], '.4g'):>{widths[n]}} " for n in yours)
                     + f"{show(r[objective], '.4f'):>{widths[objective]}} "
                     f"{show(r['seconds'], '.1f'):>7}")
    return "\n".join(lines)


def plot_trials(rows, path, title, objective, curves=None):
    """The session's picture (draw_trials) written to `path`."""
    fig = draw_trials(rows, title, objective, curves)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_trials(rows, title, objective, curves=None):
    """The objective against the learning rate used, one colour per global batch; beside
    it, each trial's objective by epoch (curves: trial id -> [(epoch, figure)]), a pruned
    trial's curve dashed and ending in a cross. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r[objective] is not None and r["learning_rate"]]
    fig, (ax, by_epoch) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in rows:
        points = (curves or {}).get(r["trial"])
        if not points:
            continue
        pruned = r["status"].startswith("PRUNED")
        line, = by_epoch.plot(*zip(*points), "--" if pruned else "o-", alpha=0.8,
                              label=f"trial {r['trial']}")
        if pruned:
            by_epoch.plot(*points[-1], "x", color=line.get_color(), markersize=10)
    by_epoch.set(xlabel="epoch", ylabel=objective, title="each trial by epoch (x: pruned)")
    by_epoch.xaxis.get_major_locator().set_params(integer=True)
    by_epoch.title.set_fontsize(9)
    by_epoch.grid(alpha=0.3)
    for i, batch in enumerate(sorted({r["global_batch_size"] for r in done})):
        for pruned in (False, True):
            points = [r for r in done if r["global_batch_size"] == batch
                      and r["status"].startswith("PRUNED") == pruned]
            if points:
                ax.scatter([r["learning_rate"] for r in points], [r[objective] for r in points],
                           label=f"batch {batch:.0f}" + (", pruned" if pruned else ""),
                           s=60 if pruned else 40, marker="x" if pruned else "o",
                           color=f"C{i}")
    ax.set(xscale="log", xlabel="learning rate used (base_lr x rule(batch/256))",
           ylabel=f"{objective} (held-out part of the training data)",
           **({"ylim": (0, 1)} if "acc" in objective else {}))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if done:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def best_flagfile(cfg, path, objective, value, note=""):
    """The best trial's RunConfig as a flagfile that tfmulti.main runs as is, on all the
    training data (the validation part too: --validation_split=0)."""
    lines = [f"# python -m tfmulti.main --flagfile={path}",
             f"# The best trial of the tuning session in {os.path.dirname(path)}: {objective} "
             f"{value:.4f} in the session's epochs, on "
             + (f"the split {cfg.validation_set}." if cfg.validation_set else
                f"the {cfg.validation_split:g} of the training data it held out."),
             "# This trains on all the training data and reports the test set, which the "
             "session never evaluated."] + ([f"# {note}"] if note else [])
    cfg = dataclasses.replace(cfg, validation_split=0.0)
    with storage.replacing(path, "w") as f:
        f.write("\n".join(lines + cfg.flag_lines("main")) + "\n")


def trial_curves(tuner, objective):
    """trial id -> [(epoch, objective)] from each trial's run folder (trial.py)."""
    curves = {}
    for trial_id in tuner.oracle.trials:
        history, _ = trial_history(tuner.get_trial_dir(trial_id))
        points = [(r["epoch"], r[objective.key]) for r in history if objective.key in r]
        if points:
            curves[trial_id] = points
    return curves


def summarize(tuner, out, title, note=""):
    objective = tuner.hypermodel.objective
    rows = trial_rows(tuner)
    if not rows:
        raise UserError("the session has no trials")
    print(format_table(rows, objective.name))
    write_table(rows, os.path.join(out, "trials.csv"))
    plot_trials(rows, os.path.join(out, "accuracy.png"), title, objective.name,
                trial_curves(tuner, objective))
    finished = [r for r in rows if r[objective.name] is not None
                and not r["status"].startswith("PRUNED")]
    if not finished:
        raise UserError("every trial failed; see the table above")
    best = finished[0]
    for row in finished[1:]:
        if objective.better(row[objective.name], best[objective.name]):
            best = row
    hp = tuner.oracle.trials[best["trial"]].hyperparameters
    best_flagfile(tuner.hypermodel.trial_config(hp, hp.values.get("tuner/epochs")),
                  os.path.join(out, "best.cfg"), objective.name, best[objective.name], note)
    return best, rows
