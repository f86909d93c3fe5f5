"""The main job: trains the book's ResNet-18 variant (or LeNet) across devices and workers.

Reads the flags into a RunConfig, checks every flag, the devices and the data before anything
is made on disk, then starts the devices and calls train.train_and_evaluate.
"""
import dataclasses

from tfmulti.bench import advise, batchsize
from tfmulti.data import service as data_service
from tfmulti.data import sources
from tfmulti.decoded import dataonce
from tfmulti.distribution import startup, storage, workers
from tfmulti.models import usermodel, zoo
from tfmulti.run import config, flagdefs
from tfmulti.run.plan import run_plan
from tfmulti.rundir import lifecycle
from tfmulti.training import train


def main():
    cfg = config.from_flags(flagdefs.FLAGS)
    start = startup.from_config(cfg)  # flag errors before anything starts
    threads = (lifecycle.replica_threads_as_recorded(cfg, start.plan)  # resumed on fewer
               if start.cluster is None else 0)
    if threads:
        start = dataclasses.replace(start, threads=(threads, start.threads[1]))
    if start.cluster is None and cfg.per_replica_batch_size != config.AUTO_BATCH:
        run_plan(cfg, start.plan.count)  # a batch that cannot work: one line, now
    # The devices are set before TensorFlow's runtime starts, and a cluster's collectives
    # before any tensor exists; your module may start the runtime when it is imported (a
    # layer adapted at its top, as Keras's examples do), and so may loading a data set
    # (tf.data, decoding): both come after them, and before anything is made on disk.
    strategy = start.start()
    if usermodel.is_spec(cfg.model):
        usermodel.load_function(cfg.model)
    # With several workers, each checks its share of a folder's files, and they agree.
    dataset = sources.load_for(cfg, start.place, workers.smallest_across(strategy, start.place)
                               if start.cluster else None)
    zoo.check_input(cfg.model, dataset.input_shape, dataset.num_classes, dataset.images,
                    dataset.test_size > 0)
    if cfg.data_service:  # its workers read the files: the dispatcher must be there
        data_service.check_servable(dataset)
        data_service.check_reachable(cfg.data_service)
    elif start.cluster is None:  # several workers each read only their share of the files
        dataset = dataonce.for_run(dataset, flagdefs.FLAGS.decode_once, start.role.leads)
    existed = bool(cfg.model_dir) and storage.exists(cfg.model_dir)
    # The chief holds the folder's lock for the whole run: a second run there is refused
    directory = cfg.model_dir or lifecycle.default_model_dir(cfg.model, cfg.dataset)
    with lifecycle.removed_if_interrupted(directory, existed), \
            lifecycle.in_use(directory, cfg.overwrite, start.role.leads) as model_dir, \
            lifecycle.removed_if_refused(model_dir, existed):
        found = None
        if cfg.per_replica_batch_size == config.AUTO_BATCH:
            cfg, found = batch_found(cfg, strategy, dataset, start, model_dir)
        line, _ = train.train_and_evaluate(strategy, dataset, cfg, model_dir=model_dir,
                                           command=flagdefs.command_line(), role=start.role,
                                           batch_search=found)
    if start.role.leads:
        print(line)
        left = [name for name in ("metrics.json", "accuracy.png", "tensorboard/", "model.keras",
                                  "saved_model/", "model.weights.h5")
                if storage.exists(storage.join(model_dir, name.rstrip("/")))]
        print(f"report: {model_dir}/ ({', '.join(left)})")  # what the run wrote


def xla_of_batch(cfg, device):
    """Whether the batch search times each candidate with XLA: --jit_compile=on, or under auto
    the doctor's verdict for that batch (the step the run would train at it)."""
    if cfg.jit_compile != "auto":
        return cfg.jit_compile == "on"
    return lambda batch: advise.jit_for(cfg, batch, device)[0]


def batch_found(cfg, strategy, dataset, start, model_dir):
    """(cfg with --per_replica_batch_size=auto resolved, what was found): the global batch of
    the run in model_dir when it resumes one (run.json), else the batch searched on each
    worker's first device, the smallest of the workers'. Says which in one line."""
    say = print if start.role.leads else (lambda line: None)
    earlier = lifecycle.earlier_run(model_dir) if not cfg.overwrite else None
    if earlier is not None:
        found = {**earlier.get("batch_search", {}), "resumed": True,
                 "per_replica_batch_size": earlier["global_batch_size"]
                 // strategy.num_replicas_in_sync}
        say(batchsize.found_line(found))
        return dataclasses.replace(cfg, per_replica_batch_size=None,
                                   global_batch_size=earlier["global_batch_size"]), found
    device = strategy.extended.worker_devices[0]
    found = batchsize.search(device, cfg.model, cfg.width, cfg.dtype, dataset,
                             max(1, dataset.train_size // (strategy.num_replicas_in_sync
                                                           * batchsize.LEAST_STEPS_PER_EPOCH)),
                             jit_compile=xla_of_batch(cfg, device), say=say)
    if start.cluster is not None:  # every worker trains the same batch
        found["per_replica_batch_size"] = workers.smallest_across(strategy, start.place)(
            found["per_replica_batch_size"])
    say(batchsize.found_line(found))
    return dataclasses.replace(cfg, per_replica_batch_size=found["per_replica_batch_size"]), found

