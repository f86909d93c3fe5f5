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
4. Its chief serves the oracle to any caller (add_insecure_port): `require_secret` makes the
   chief's server (keras_tuner.src.distribute.oracle_chief.start_server, which the chief's
   tuner calls) run only calls carrying the session's secret (secret.py), and every
   OracleClient (a worker's tuner) send it. Asked for port 0, the server binds a free port
   and puts it in KERASTUNER_ORACLE_PORT before CHIEF_LISTENING is set (no port chosen
   early and taken by another process before the bind).
5. It ends a trial by writing its trial.json (COMPLETED, with its score) and then the
   oracle.json that no longer lists it as ongoing: a kill in between made the reload send the
   finished trial to the retry queue, and the resumed session ran it again (a pruned trial
   was decided anew). `requeue_running` also takes such trials out of the queue and counts
   them as ended.
"""
import json
import os
import threading
import time

from tfmulti.distribution import storage
from tfmulti.tune import secret

CHECKED = ("1.4.7", "1.4.8")  # the keras-tuner versions these fixes were checked against
CHIEF_LISTENING = threading.Event()  # set once the chief's server listens (fix 4)


def _atomic(in_place):
    """save_json that writes a local file whole: a temporary file in the same folder, renamed
    over the old one (os.replace is atomic there). URLs go to keras-tuner's own writer."""

    def save_json(path, obj):
        if "://" in str(path):
            return in_place(path, obj)
        text = json.dumps(obj)
        # made as open() makes a file (0666 less the umask: a group-shared session stays
        # shared), and removed when the write fails (a full disk): no *.tmp left behind
        with storage.replacing(str(path), "w") as f:
            f.write(text)
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
    """After a reload, when no trial of this session is running anywhere. Fix 2: the
    oracle's RUNNING trials go back in its retry queue, so the next worker to ask runs them
    again. Fix 5: a trial its own trial.json says ended (COMPLETED or FAILED) leaves the
    queue and is counted as ended."""
    import keras_tuner as kt

    status = kt.engine.trial.TrialStatus
    for trial in oracle.trials.values():
        if (trial.status == status.RUNNING
                and trial.trial_id not in oracle._retry_queue):
            oracle._retry_queue.append(trial.trial_id)
        elif trial.status in (status.COMPLETED, status.FAILED):
            while trial.trial_id in oracle._retry_queue:
                oracle._retry_queue.remove(trial.trial_id)
            if trial.trial_id not in oracle.end_order:
                oracle.end_order.append(trial.trial_id)


def bound_oracle_calls(seconds):
    """Fix 3: a distributed worker's calls to the chief give up after `seconds`."""
    from keras_tuner.src.distribute import oracle_client

    oracle_client.TIMEOUT = seconds


def require_secret(folder, make):
    """Fix 4: the chief serves only callers with the secret of the session in `folder`
    (made there when `make`: the chief); returns its path. Call before a tuner is made."""
    from keras_tuner.src import protos
    from keras_tuner.src.distribute import oracle_chief, oracle_client

    path = secret.make(folder) if make else os.path.join(folder, secret.FILE)
    os.environ[secret.VARIABLE] = path
    if getattr(oracle_chief.start_server, "tfmulti_secret", False):
        return path

    def start_server(oracle):  # keras-tuner's own, with the secret's server
        server = secret.server(os.environ[secret.VARIABLE])  # no secret, no server
        servicer = oracle_chief.OracleServicer(oracle)
        protos.get_service_grpc().add_OracleServicer_to_server(servicer, server)
        port = secret.listen(server, f"{os.environ['KERASTUNER_ORACLE_IP']}:"
                                     f"{os.environ['KERASTUNER_ORACLE_PORT']}")
        os.environ["KERASTUNER_ORACLE_PORT"] = str(port)  # the one bound, when asked for 0
        server.start()
        CHIEF_LISTENING.set()
        while True:
            time.sleep(1)
            if servicer.stop_triggered:
                while not oracle_chief.exit_chief(oracle):
                    time.sleep(20)
                break

    start_server.tfmulti_secret = True
    oracle_chief.start_server = start_server
    plain_init = oracle_client.OracleClient.__init__

    def init(self, oracle):
        plain_init(self, oracle)
        if secret.VARIABLE not in os.environ:  # not a tfmulti session: keras-tuner's own
            return
        address = f"{os.environ['KERASTUNER_ORACLE_IP']}:{os.environ['KERASTUNER_ORACLE_PORT']}"
        self.stub = protos.get_service_grpc().OracleStub(
            secret.channel(address, os.environ[secret.VARIABLE]))

    oracle_client.OracleClient.__init__ = init
    return path
