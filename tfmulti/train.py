"""The main job as a library function: data + model + engine + report, for any strategy."""
import datetime
import os
import shutil

from tfmulti import data, devices, engine, hparams, models, report
from tfmulti.errors import UsageError


def default_model_dir(model, dataset, now=None):
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{model}-{dataset}")


def prepare_model_dir(model_dir, overwrite=False):
    """Refuses to write over an earlier run unless asked; with overwrite, clears its files."""
    present = [f for f in report.RUN_FILES if os.path.exists(os.path.join(model_dir, f))]
    if present and not overwrite:
        raise UsageError(f"--model_dir={model_dir} already holds a run ({', '.join(present)}); "
                         "pass --overwrite to replace it or choose another --model_dir")
    if os.path.exists(model_dir) and not os.path.isdir(model_dir):
        raise UsageError(f"--model_dir={model_dir} is a file, not a directory")
    for name in present + [report.PLOT_FILE, report.TENSORBOARD_DIR]:
        path = os.path.join(model_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    try:
        os.makedirs(model_dir, exist_ok=True)
        probe = os.path.join(model_dir, ".write-test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"--model_dir={model_dir} is not writable ({e.strerror})")


def train_and_evaluate(strategy, dataset, *, model="resnet18", width=None, dtype="float32",
                       sync_batchnorm=False, per_replica_batch_size=256, base_lr=0.1,
                       lr_scaling="linear", warmup_epochs=0.0, epochs=10, seed=0,
                       steps_per_call=10, model_dir=None, show_replicas=False, verbose=1,
                       run_info=None):
    """Trains `model` on `dataset` under `strategy`; returns (the book's line, history).

    model_dir None writes nothing (tests); otherwise the report files go there.
    """
    replicas = strategy.num_replicas_in_sync
    global_batch = per_replica_batch_size * replicas
    learning_rate = hparams.scaled_learning_rate(base_lr, global_batch, lr_scaling)
    steps = data.steps_per_epoch(len(dataset.train_images), global_batch)
    if steps < 1:
        raise UsageError(f"global batch {global_batch} is larger than the "
                         f"{len(dataset.train_images)} training examples")
    if epochs < 1:
        raise UsageError(f"--epochs={epochs}: train for at least one epoch")
    if warmup_epochs < 0:
        raise UsageError(f"--warmup_epochs={warmup_epochs} is negative")
    eng = engine.Engine(
        strategy,
        lambda: models.build(model, width, dtype=dtype, sync_batchnorm=sync_batchnorm, seed=seed),
        learning_rate, global_batch, warmup_steps=round(warmup_epochs * steps),
        loss_scaling=dtype == "mixed_float16", steps_per_call=steps_per_call)
    names = devices.replica_names(strategy)
    if show_replicas:
        first = eng.model.trainable_variables[0]
        print(f"{first.path}, first values on each replica:")
        for device, values in eng.replica_values(first):
            print(f"  {device}: {values}")
    info = {
        "model": model, "width": width or models.BOOK_WIDTH[model], "dtype": dtype,
        "dataset": dataset.display_name, "dataset_source": dataset.source,
        "train_examples": len(dataset.train_images), "test_examples": len(dataset.test_images),
        "devices": names, "replicas": replicas, "per_replica_batch_size": per_replica_batch_size,
        "global_batch_size": global_batch, "base_lr": base_lr, "lr_scaling": lr_scaling,
        "learning_rate": learning_rate, "warmup_epochs": warmup_epochs,
        "steps_per_epoch": steps, "versions": report.versions(), **(run_info or {}),
    }
    run = report.RunReport(model_dir, info, write_files=model_dir is not None)
    on_epoch_end = run.on_epoch_end
    if model_dir is not None:
        manager = eng.checkpoint_manager(os.path.join(model_dir, "checkpoints"))

        def on_epoch_end(record):
            manager.save(checkpoint_number=record["step"])
            run.on_epoch_end(record)
    if verbose:
        print(f"Training {model} on {dataset.display_name} ({len(dataset.train_images)} images) "
              f"on [{', '.join(names)}]: global batch {global_batch} "
              f"({per_replica_batch_size} per replica), learning rate {learning_rate:g}")
    history = eng.fit(
        data.train_input_fn(dataset.train_images, dataset.train_labels, per_replica_batch_size,
                            seed),
        data.eval_input_fn(dataset.test_images, dataset.test_labels, per_replica_batch_size),
        epochs, steps, data.eval_steps(len(dataset.test_images), global_batch),
        on_epoch_end=on_epoch_end, verbose=verbose)
    return run.finish(eng.model), history
