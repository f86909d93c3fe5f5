"""keras-tuner's patches, in one place, each with why.

A tuning session must survive a kill at any moment and resume (rerun the same command).
keras-tuner falls short twice; checked against keras-tuner 1.4.7 and 1.4.8 (CHECKED), and
tests/test_tune.py fails if a later keras-tuner changes what these rely on:

1. It writes its state (oracle.json, trial.json) in place: a kill during the write left an
   empty oracle.json and a session that could not be resumed (seen in CI). `apply` makes it
   write a temporary file and rename it over the old one. It replaces
   keras_tuner.src.utils.save_json, through which every state file is written
   (Stateful.save, Tuner.run_trial call `utils.save_json`). Applied by the entry point, not
   on import: importing this module changes nothing.
2. It writes a new trial's trial.json before the oracle.json that lists it: a kill in between
   left that trial RUNNING for ever on resume (never rerun, never counted as done).
   `requeue_running` puts such trials in the oracle's retry queue, as Oracle.reload does with
   the ongoing ones. keras-tuner has no public way to retry a trial: this uses the private
   `Oracle._retry_queue`, the list `create_trial` takes retried trials from first.
3. A distributed worker's calls to the chief wait for it up to an hour
   (keras_tuner.src.distribute.oracle_client.TIMEOUT, read at each call): `bound_oracle_calls`
   sets the worker's own limit (--worker_timeout), after which the call raises.
"""
import json
import os
import tempfile

CHECKED = ("1.4.7", "1.4.8")  # the keras-tuner versions these fixes were checked against


def _atomic(in_place):
    """save_json that writes a local file whole: a temporary file in the same folder, renamed
    over the old one (os.replace is atomic there). URLs go to keras-tuner's own writer."""

    def save_json(path, obj):
        if "://" in str(path):
            return in_place(path, obj)
        text = json.dumps(obj)
        directory = os.path.dirname(os.path.abspath(path))
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as f:
            f.write(text)
        os.replace(f.name, path)
        return text

    save_json.tfmulti_atomic = True
    return save_json


def apply():
    """Makes keras-tuner write its state files whole (fix 1). Call before a tuner is made;
    calling it again changes nothing."""
    from keras_tuner.src import utils

    if not getattr(utils.save_json, "tfmulti_atomic", False):
        utils.save_json = _atomic(utils.save_json)


def requeue_running(oracle):
    """Fix 2: the oracle's RUNNING trials go back in its retry queue (after a reload, when no
    trial of this session is running anywhere), so the next worker to ask runs them again."""
    import keras_tuner as kt

    for trial in oracle.trials.values():
        if (trial.status == kt.engine.trial.TrialStatus.RUNNING
                and trial.trial_id not in oracle._retry_queue):
            oracle._retry_queue.append(trial.trial_id)


def bound_oracle_calls(seconds):
    """Fix 3: a distributed worker's calls to the chief give up after `seconds`."""
    from keras_tuner.src.distribute import oracle_client

    oracle_client.TIMEOUT = seconds
