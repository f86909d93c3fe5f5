"""Tuning across the tasks of a Slurm step: `srun -n3 python -m tfmulti.tune ...`.

Task 0 is keras-tuner's chief: it serves the oracle at its own address (the port slurm.py
gives the step's first task) and runs trials on its own devices too, asking its oracle
directly. Every other task is a tuning worker, `tuner<rank>`, that asks the chief for a
trial, trains it in a process of its own on the task's devices (as a serial session does),
reports, and asks again: keras-tuner's own distributed mode, its KERASTUNER_* variables set
from Slurm's. The tasks share the session folder (a shared file system, as a multi-worker
run's folder is).

Tasks on other nodes cannot watch each other's processes, so every task writes a beat,
<session>/workers/<tuner id>.beat, every BEAT_SECONDS, and reads the others' (Beats):
- a worker silent for --worker_timeout (killed, its node lost) has its trial put back for
  the next task that asks, task 0 included (not counted as a failed attempt), and is no
  longer waited for;
- after the last trial the chief waits until every worker has been told the search is over
  (its beat says done) or is silent, so a worker that starts late still finds a chief;
- a worker whose chief is silent for --worker_timeout stops, with one line, and its calls to
  the oracle wait at most --worker_timeout (keras-tuner's own limit is an hour).
A beat names the job's incarnation (job, step, restart count): a requeued job does not take
the beats an earlier run of it left for signs of life.
"""
import contextlib
import os
import sys
import threading
import time

from tfmulti.distribution import storage
from tfmulti.errors import UserError
from tfmulti.tune import keras_tuner_fixes, secret, stopping

BEAT_SECONDS = 1.0  # how often a task writes its beat
# Held by whichever of a worker's two limits (its call to the chief, its watch on the chief's
# beat) gives up first: the other then says nothing, so the worker stops with one line.
_GIVING_UP = threading.Lock()


def roles(cluster):
    """keras-tuner's variables for this task of a step (slurm.cluster's TF_CONFIG dict):
    task 0 the chief, serving at its own address; the others tuner<rank>."""
    host, port = cluster["cluster"]["worker"][0].rsplit(":", 1)
    rank = cluster["task"]["index"]
    return {"KERASTUNER_TUNER_ID": "chief" if rank == 0 else f"tuner{rank}",
            "KERASTUNER_ORACLE_IP": host, "KERASTUNER_ORACLE_PORT": port}


def worker_ids(cluster):
    """The tuner ids of the step's workers (every task but the chief)."""
    return [f"tuner{i}" for i in range(1, len(cluster["cluster"]["worker"]))]


def incarnation(environ):
    """This run of the job: a requeued job keeps its id and counts SLURM_RESTART_COUNT."""
    return ".".join(environ.get(k, "0") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID",
                                                  "SLURM_RESTART_COUNT"))


class Beats:
    """This task's beat, written from a thread, and what it sees of the others' beats.

    A beat file holds "<incarnation> <count> <state>", written whole (renamed into place).
    silent_for(id) is measured on this process's own clock from the last change it saw, so
    the nodes' clocks need not agree; a task never seen counts from when this one started.
    """

    def __init__(self, folder, own_id, incarnation, period=BEAT_SECONDS):
        self.folder, self.own_id, self.incarnation, self.period = (
            folder, own_id, incarnation, period)
        self.state, self.count = "running", 0
        self._seen = {}  # tuner id -> (content, when it last changed)
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = None

    def path(self, tuner_id):
        return os.path.join(self.folder, f"{tuner_id}.beat")

    def beat(self):
        os.makedirs(self.folder, exist_ok=True)  # also after an --overwrite emptied it
        self.count += 1
        with storage.replacing(self.path(self.own_id), "w") as f:
            f.write(f"{self.incarnation} {self.count} {self.state}\n")

    def start(self, on_beat=None):
        """Beats every period from a daemon thread; on_beat() runs after each."""
        def loop():
            while not self._stop.is_set():
                try:
                    self.beat()
                except OSError:  # a shared file system's hiccup: the next beat tries again
                    pass
                if on_beat is not None:
                    on_beat()
                self._stop.wait(self.period)

        self.beat()
        self._thread = threading.Thread(target=loop, name="tuning-beat", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        """No more beats (this task stops without finishing: the others see it fall
        silent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def done(self):
        """The last beat: this task is finished (the chief stops waiting for it)."""
        self.stop()
        self.state = "done"
        self.beat()

    def read(self, tuner_id):
        """(count, state) of tuner_id's beat of this incarnation, or None."""
        try:
            with open(self.path(tuner_id)) as f:
                parts = f.read().split()
        except OSError:
            return None
        if len(parts) != 3 or parts[0] != self.incarnation:
            return None  # torn or an earlier run's
        return parts[1], parts[2]

    def silent_for(self, tuner_id):
        """Seconds since tuner_id's beat last changed, as this process saw it."""
        now, content = time.monotonic(), self.read(tuner_id)
        last = self._seen.get(tuner_id)
        if content is not None and (last is None or last[0] != content):
            self._seen[tuner_id] = (content, now)
            return 0.0
        return now - (last[1] if last else self._started)

    def is_done(self, tuner_id):
        content = self.read(tuner_id)
        return content is not None and content[1] == "done"


def _synchronized(function):
    """function(oracle, ...) under the oracle's lock, as keras-tuner's own calls are."""
    from keras_tuner.src.engine.oracle import synchronized

    return synchronized(function)


def _put_back(oracle, tuner_id):
    """A silent worker's trial goes back in the retry queue (not counted as an attempt), and
    the worker is no longer waited for. Returns the trial's id, or None."""
    trial = oracle.ongoing_trials.pop(tuner_id, None)
    oracle.tuner_ids.discard(tuner_id)
    if trial is None:
        return None
    if trial.trial_id not in oracle._retry_queue:
        oracle._retry_queue.append(trial.trial_id)
    oracle.save()
    return trial.trial_id


def _left(oracle):
    """Nothing for anyone to run: no trial under way and none waiting to be retried."""
    return not oracle.ongoing_trials and not oracle._retry_queue


def run_own_trials(tuner, poll=1.0):
    """keras-tuner's search loop for the chief's own tuner on its own oracle (keras-tuner's
    search() on a chief only serves): trials for this task until the oracle has none left
    to give it. The oracle's calls are synchronized with the ones the server answers."""
    from keras_tuner.src.engine.trial import TrialStatus

    tuner.on_search_begin()
    while True:
        tuner.pre_create_trial()
        trial = tuner.oracle.create_trial(tuner.tuner_id)
        if trial.status == TrialStatus.STOPPED:
            break
        if trial.status == TrialStatus.IDLE:  # hyperband: its bracket's other trials first
            time.sleep(poll)
            continue
        tuner.on_trial_begin(trial)
        tuner._try_run_and_update_trial(trial)
        # on_trial_end saves the oracle (Oracle.save is not synchronized): under its lock
        _synchronized(lambda oracle, ended: tuner.on_trial_end(ended))(tuner.oracle, trial)
    tuner.on_search_end()


def lead(tuner, address, expected, beats, timeout, poll=1.0, stop_check=lambda: None):
    """The chief: serves the oracle at `address` and runs trials itself (run_own_trials)
    until the search is over and every expected worker is done or silent for `timeout` s.
    A silent worker's trial is put back for the next task that asks, this one included.
    stop_check() raises to stop it while it waits (a SIGTERM). Returns the workers that fell
    silent."""
    from keras_tuner.src import protos
    from keras_tuner.src.distribute.oracle_chief import OracleServicer

    oracle = tuner.oracle
    put_back, left = _synchronized(_put_back), _synchronized(_left)
    tuner.save()
    server = secret.server(os.environ[secret.VARIABLE])  # only callers with the secret
    protos.get_service_grpc().add_OracleServicer_to_server(OracleServicer(oracle), server)
    secret.listen(server, address)  # its port probed at start: one line if taken since
    server.start()
    gone = set()

    def watch_workers():  # from the beat thread: also while this task trains
        for tuner_id in expected:
            if tuner_id in gone or beats.is_done(tuner_id):
                continue
            silent = beats.silent_for(tuner_id)
            if silent > timeout:
                gone.add(tuner_id)
                trial = put_back(oracle, tuner_id)
                print(f"{tuner_id}: no beat for {silent:.0f} s (--worker_timeout): not "
                      "waited for" + (f"; its trial {trial} goes to the next task that asks"
                                      if trial is not None else ""), flush=True)

    beats.start(on_beat=watch_workers)
    try:
        while True:
            run_own_trials(tuner, poll)
            settled = all(t in gone or beats.is_done(t) for t in expected)
            if settled and left(oracle):
                break
            stop_check()
            time.sleep(poll)
    except BaseException:
        beats.stop()  # not done: the workers see the chief fall silent
        raise
    finally:  # stop() returns at once; its event is set when the port is let go
        server.stop(grace=2).wait(timeout=10)
    oracle.save()
    beats.done()
    return gone


@contextlib.contextmanager
def chief_answers(chief_address, timeout):
    """A worker's calls to the chief (keras-tuner's) give up after `timeout` s, in one line."""
    import grpc

    keras_tuner_fixes.bound_oracle_calls(timeout)
    try:
        yield
    except grpc.RpcError as e:
        _GIVING_UP.acquire()  # if the watch on the chief's beat said it first, it exits
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise UserError(f"the tuning chief ({chief_address}) refused this worker: it does "
                            f"not have the session's secret ({os.environ.get(secret.VARIABLE)})"
                            ) from None
        raise UserError(f"the tuning chief ({chief_address}) did not answer within "
                        f"{timeout:.0f} s (--worker_timeout): {e.code().name}") from None


def work(tuner, chief_address, beats, timeout):
    """A worker: asks the chief for trials until it says stop. Its calls and its watch on the
    chief's beat give up after `timeout` s, with one line. Stopped by SIGTERM, it stops as
    a serial session does (its trial's checkpoint saved), also when the chief went first."""
    stopper = tuner.hypermodel.stopper

    def watch_chief():
        silent = beats.silent_for("chief")
        if (silent > timeout and not beats.is_done("chief") and not stopper.by
                and _GIVING_UP.acquire(False)):
            print(f"tfmulti: error: the tuning chief ({chief_address}) has been silent for "
                  f"{silent:.0f} s (--worker_timeout); this worker stops. Run the job again to "
                  "resume the session", file=sys.stderr, flush=True)
            os._exit(1)  # its trial's process dies with it (PR_SET_PDEATHSIG)

    beats.start(on_beat=watch_chief)
    try:
        with chief_answers(chief_address, timeout):
            tuner.search(verbose=0)
    except UserError:
        if stopper.by:  # the chief stopped first, on the same SIGTERM: this one stops too
            raise stopping.SessionStopped(stopper.by, ", the chief stopped with it") from None
        raise
    beats.done()
