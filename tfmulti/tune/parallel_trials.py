"""K trials at once: keras-tuner's distributed mode on one machine (tune --parallel_trials=K).

The `python -m tfmulti.tune` process is the chief: its tuner serves the oracle (keras-tuner
starts the server when KERASTUNER_TUNER_ID=chief) from a thread, while this module starts K
worker processes, `python -m tfmulti.tune <the same flags>` with KERASTUNER_TUNER_ID=tuner<i>,
each on its own share of the devices: GPUs through CUDA_VISIBLE_DEVICES, CPU replicas as a
smaller --cpu_replicas pinned to their cores with taskset. A worker asks the oracle for a
trial, runs it in a process of its own (as a serial session does), reports, asks again.

keras-tuner's chief waits for ever on a worker that died (keras-team/keras-tuner#915); here
the chief watches its workers (the supervisor, processes/supervisor.py): a worker that dies
has its trial ended as crashed (so it is retried, --max_retries_per_trial, by whichever worker
asks next) and is started again, up to RESTARTS times. SIGTERM or Ctrl-C to the chief stops
the workers and keeps the finished trials; killing the chief kills them. The session state is
the oracle's, on disk: rerunning the same command resumes.
"""
import dataclasses
import os
import shutil
import signal
import sys
import threading
import time

from tfmulti.distribution import devices
from tfmulti.distribution.startup import Role
from tfmulti.errors import PREEMPTED_EXIT_CODE, UserError
from tfmulti.processes import supervisor
from tfmulti.tune import keras_tuner_fixes

RESTARTS = 2  # times a dead worker is started again before its devices are given up
STOP_SECONDS = 10.0  # a worker's time to stop after SIGTERM before SIGKILL
LISTEN_SECONDS = 60.0  # longest wait for the chief's server to listen


def role():
    """This process in its session: ALONE (a serial session), or CHIEF/WORKER under
    keras-tuner's distributed mode (its environment)."""
    if "KERASTUNER_ORACLE_IP" not in os.environ:
        return Role.ALONE
    return Role.CHIEF if "chief" in os.environ.get("KERASTUNER_TUNER_ID", "") else Role.WORKER


def become_chief():
    """Makes this process keras-tuner's chief; call before the tuner is made. Its server
    takes a free port as it binds (keras_tuner_fixes fix 4), the workers are given it."""
    keras_tuner_fixes.CHIEF_LISTENING.clear()
    os.environ.update(KERASTUNER_TUNER_ID="chief", KERASTUNER_ORACLE_IP="127.0.0.1",
                      KERASTUNER_ORACLE_PORT="0")


@dataclasses.dataclass
class Worker:
    """A tuning worker: its share of the devices, its supervised process, how often it died."""
    tuner_id: str
    share: devices.Share
    child: supervisor.Child
    deaths: int = 0
    state: str = "running"  # or "done", "given up"

    @property
    def log_path(self):
        return self.child.log


def start_worker(group, index, share, argv, model_dir, log_dir):
    """Starts worker `index` under the supervisor `group`, pinned to its share's cores, its
    output appended to <log_dir>/tuner<index>.log."""
    tuner_id = f"tuner{index}"
    pin = ["taskset", "-c", ",".join(map(str, share.cores))] if shutil.which("taskset") else []
    log_path = os.path.join(log_dir, f"{tuner_id}.log")
    print(f"{tuner_id}: {share.label} (log: {log_path})", flush=True)
    child = group.start(tuner_id, pin + worker_command(argv, share, model_dir),
                        {**share.env, "KERASTUNER_TUNER_ID": tuner_id}, log=log_path)
    return Worker(tuner_id, share, child)


def worker_command(argv, share, model_dir):
    """The tune command a worker runs: the user's flags, its share, the same session."""
    return [sys.executable, "-m", "tfmulti.tune", *argv, *share.flags, "--parallel_trials=1",
            "--nooverwrite", f"--model_dir={model_dir}"]


def _end_as_crashed(oracle, tuner_id, why):
    """The dead worker's trial, if it had one, ends as crashed: the oracle retries it."""
    import keras_tuner as kt

    trial = oracle.ongoing_trials.get(tuner_id)
    if trial is None:
        return None
    trial.status, trial.message = kt.engine.trial.TrialStatus.INVALID, why
    oracle.end_trial(trial)
    return trial.trial_id


def run(tuner, shares, argv, model_dir, restarts=RESTARTS, poll=supervisor.POLL_SECONDS,
        listen_seconds=LISTEN_SECONDS):
    """Serves the oracle and runs K workers until the search ends; returns the workers."""
    log_dir = os.path.join(model_dir, "workers")
    os.makedirs(log_dir, exist_ok=True)
    failure = []

    def serve():
        try:
            tuner.search(verbose=1)  # the chief: blocks while it serves the workers
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failure.append(e)

    chief = threading.Thread(target=serve, name="oracle-chief", daemon=True)
    chief.start()
    listening(chief, failure, keras_tuner_fixes.CHIEF_LISTENING, listen_seconds)
    with supervisor.Supervisor(noun="tuning worker", poll=poll) as group:
        workers = [start_worker(group, i, share, argv, model_dir, log_dir)
                   for i, share in enumerate(shares)]
        by_child = {w.child: w for w in workers}
        while any(w.state == "running" for w in workers):
            if group.signals:
                _interrupted(group, tuner, group.signals[0], workers)
            if not chief.is_alive():
                if failure:
                    raise UserError(f"the tuning chief stopped: {type(failure[0]).__name__}: "
                                    f"{failure[0]}")
                break  # the search is over; the oracle has ended every trial
            for child, code in group.ended():
                _ended(group, tuner, by_child[child], code, restarts)
            time.sleep(poll)
        group.stop(STOP_SECONDS, "the search is over")
    # keras-tuner's chief saves the oracle before it lets go of an ended trial, and only a
    # serial tuner saves it again: without this the last trial would look unfinished on resume.
    tuner.oracle.save()
    unfinished = [t.trial_id for t in tuner.oracle.trials.values()
                  if str(t.status) in ("RUNNING", "INVALID", "IDLE")]
    if unfinished or all(w.state == "given up" for w in workers):
        raise UserError(f"the session stopped with trial(s) {', '.join(unfinished) or 'not run'}"
                        " unfinished: every worker died (see the logs in "
                        f"{log_dir}); run the same command again to resume")
    return workers


def listening(chief, failure, event, seconds):
    """Waits until the chief's server listens (its port is then in the environment the
    workers get); UserError if its thread failed or `seconds` passed first."""
    deadline = time.monotonic() + seconds
    while not event.wait(0.1):
        if failure:
            raise UserError(str(failure[0]) if isinstance(failure[0], UserError) else
                            f"the tuning chief stopped: {type(failure[0]).__name__}: "
                            f"{failure[0]}")
        if not chief.is_alive() or time.monotonic() > deadline:
            raise UserError(f"the tuning chief's server did not start listening within "
                            f"{seconds:g} s; no worker was started")


def _ended(group, tuner, worker, code, restarts):
    """A worker's process ended: done, or dead (its trial ended as crashed, so it is retried,
    and the worker started again up to `restarts` times)."""
    if code == 0:
        worker.state = "done"
        return
    worker.deaths += 1
    trial = _end_as_crashed(tuner.oracle, worker.tuner_id,
                            f"its worker process died (exit code {code})")
    during = f" during trial {trial}" if trial is not None else ""
    last = worker.child.last_line()
    print(f"{worker.tuner_id}: died (exit code {code}){during}"
          f"{': ' + last if last else ''}", flush=True)
    if worker.deaths <= restarts:
        print(f"{worker.tuner_id}: started again on {worker.share.label}", flush=True)
        group.restart(worker.child)
    else:
        worker.state = "given up"
        print(f"{worker.tuner_id}: given up after {worker.deaths} deaths; its "
              f"devices stay idle (log: {worker.log_path})", flush=True)


def _interrupted(group, tuner, signum, workers):
    """SIGTERM or Ctrl-C to the chief: the workers stopped (each saves its trial's
    checkpoint and exits 75, stopping.py), the finished trials kept. Exit 75 when every
    worker saved or had ended (a batch script requeues the session), else 128 + signum."""
    group.stop(STOP_SECONDS, f"{signal.Signals(signum).name} received")
    tuner.oracle.save()
    saved = all(w.child.poll() in (0, PREEMPTED_EXIT_CODE) for w in workers)
    print(f"tfmulti: tuning stopped by {signal.Signals(signum).name}; finished trials are kept"
          + (", each worker's trial saved its checkpoint" if saved else "") + "; run the same "
          "command again to go on with the session", file=sys.stderr, flush=True)
    sys.exit(PREEMPTED_EXIT_CODE if saved else 128 + signum)
