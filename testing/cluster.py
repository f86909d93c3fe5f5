"""`make cluster-test`: a real Slurm on this machine, and tfmulti run on it as users run it.

    sudo .venv/bin/python -m testing.cluster [--checks=one_node,two_nodes,...]

Needs root. Steps, one line each:
  packages   Debian's slurmd, slurmctld, slurm-client and munge, installed if missing
  daemons    munged (unless one runs), slurmctld and two slurmd on this host, the logical
             nodes n1 and n2 (4 CPUs declared each), from a slurm.conf in a temporary folder;
             n1 and n2 are added to /etc/hosts for the time of the test
  checks     each a real srun or sbatch with a time limit of its own
Whatever happens, every job is cancelled and every daemon it started is stopped, the
/etc/hosts lines it added are removed and its folder is deleted. Exit code 0 only if every
step passed.
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from testing.harness import Failed, say, step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PACKAGES = ("slurmd", "slurmctld", "slurm-client", "munge")
NODES = ("n1", "n2")
HOSTS_LINE = "127.0.0.1 n1 n2  # tfmulti cluster-test"
CHECKS = ("one_node", "two_nodes", "two_jobs", "doctor", "scancel", "kill_task", "requeue",
          "elastic", "tune", "tune_requeue", "tune_timelimit", "your_task", "no_step",
          "indivisible", "port_taken", "data_service", "no_dispatcher")
SBATCH = os.path.join(ROOT, "deploy", "slurm", "train.sbatch")
TUNE_SBATCH = os.path.join(ROOT, "deploy", "slurm", "tune.sbatch")
REQUEUE_TIMEOUT = 420  # Slurm starts a requeued job again after about 2 minutes
CHECK_TIMEOUT = 300
TRAIN = ["-m", "tfmulti.main", "--dataset=synthetic", "--synthetic_train_size=512",
         "--synthetic_test_size=128", "--model=lenet", "--width=4", "--global_batch_size=32",
         "--base_lr=2", "--epochs=2"]
SLURM_CONF = """\
ClusterName=tfmulti
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmctldPort={ctld_port}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} CPUs=4 RealMemory=4000
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2_port} CPUs=4 RealMemory=4000
PartitionName=main Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def first_error(text):
    """The first line of a task's that says an error (srun's own lines aside), else the
    last line."""
    return next((line[:300] for line in text.splitlines()
                 if ("Error" in line or "error:" in line) and not line.startswith(("srun:",
                                                                                 "slurmstepd"))),
                last_line(text))


def last_line(text):
    lines = [line for line in text.strip().splitlines()
             if line.strip() and not line.startswith(("I0000", "W0000", "E0000", "WARNING: All"))]
    return lines[-1][:300] if lines else "(no output)"


# --- the cluster ----------------------------------------------------------------------------

class Cluster:
    """The daemons of a one-host, two-node Slurm, and what to undo."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="tfmulti-cluster-")
        self.processes, self.munged, self.hosts_added = [], False, False
        self.env = {**os.environ, "SLURM_CONF": os.path.join(self.folder, "slurm.conf"),
                    "PYTHONPATH": ROOT}

    def start(self, timeout=30):
        from tfmulti.processes.launcher import free_ports

        ctld, n1, n2 = free_ports(3)
        for sub in ("state", "spool/n1", "spool/n2"):
            os.makedirs(os.path.join(self.folder, sub))
        with open(self.env["SLURM_CONF"], "w") as f:
            f.write(SLURM_CONF.format(folder=self.folder, ctld_port=ctld, n1_port=n1,
                                      n2_port=n2))
        with open("/etc/hosts") as f:
            known = f.read()
        if HOSTS_LINE not in known:
            with open("/etc/hosts", "a") as f:
                f.write(("" if known.endswith("\n") else "\n") + HOSTS_LINE + "\n")
            self.hosts_added = True
        if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
            if not os.path.exists("/etc/munge/munge.key"):
                subprocess.run(["mungekey", "-c"], check=True, capture_output=True)
            os.makedirs("/run/munge", exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "munged"], check=True,
                           capture_output=True, timeout=30)
            self.munged = True
        self.daemon(["slurmctld", "-D"])
        for node in NODES:
            self.daemon(["slurmd", "-D", "-N", node])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env,
                                    capture_output=True, text=True).stdout.split()
            if states.count("idle") == len(NODES):
                return f"slurmctld and slurmd for {', '.join(NODES)} up, both idle ({self.folder})"
            time.sleep(0.5)
        raise Failed(f"the nodes were not idle within {timeout} s: {' '.join(states)}")

    def daemon(self, command):
        log = open(os.path.join(self.folder, f"{command[0]}-{len(self.processes)}.out"), "w")
        self.processes.append(subprocess.Popen(command, env=self.env, stdout=log,
                                               stderr=subprocess.STDOUT))

    def stop(self):
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True,
                       timeout=30)
        deadline = time.monotonic() + 30  # KillWait (10 s), then SIGKILL
        while task_pids(r"tfmulti\.(main|tune|doctor)") and time.monotonic() < deadline:
            time.sleep(0.2)
        for process in reversed(self.processes):
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.munged:
            subprocess.run(["pkill", "-x", "munged"], capture_output=True)
        if self.hosts_added:
            with open("/etc/hosts") as f:
                lines = [line for line in f if line.strip() != HOSTS_LINE]
            with open("/etc/hosts", "w") as f:
                f.writelines(lines)
        shutil.rmtree(self.folder, ignore_errors=True)
        left = task_pids(r"tfmulti\.(main|tune|doctor)")
        if left:
            raise Failed(f"tfmulti processes left after the daemons stopped: {left}")
        return "every job cancelled, every daemon stopped, /etc/hosts and the folder restored"

    def run(self, command, timeout=CHECK_TIMEOUT, env=None):
        """(exit code, output) of a Slurm command (with the variables `env` added), stopped
        at its time limit."""
        try:
            result = subprocess.run(command, cwd=ROOT, env={**self.env, **(env or {})},
                                    capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            subprocess.run(["scancel", "--user=root"], env=self.env, capture_output=True)
            raise Failed(f"{' '.join(command[:4])} ... did not end within {timeout:.0f} s; "
                         "its job was cancelled")
        return result.returncode, result.stdout + result.stderr


# --- checks ---------------------------------------------------------------------------------

def trained(cluster, srun_args, model_dir, tasks):
    """srun ... python -m tfmulti.main: every task exits 0 with one weights fingerprint and
    the chief's report counts every worker."""
    code, output = cluster.run(["srun", *srun_args, "--kill-on-bad-exit=1", sys.executable,
                                *TRAIN, f"--model_dir={model_dir}"])
    if code != 0:
        raise Failed(f"srun exited {code}: {last_line(output)}")
    prints = fingerprints(model_dir)
    if len(prints) != tasks or len(set(prints)) != 1:
        raise Failed(f"{len(prints)} fingerprints for {tasks} tasks: {sorted(set(prints))}")
    with open(os.path.join(model_dir, "metrics.json")) as f:
        workers = json.load(f)["workers"]
    if workers != tasks:
        raise Failed(f"the report counts {workers} workers, not {tasks}")
    line = next((x for x in output.splitlines() if x.startswith("test acc:")), "no test acc line")
    return (f"{tasks} tasks, one weights fingerprint {prints[0]}, report: {workers} workers | "
            f"{line[:80]}")


def check_one_node(cluster, work):
    return trained(cluster, ["-N1", "-n2"], os.path.join(work, "one"), 2)


def check_two_nodes(cluster, work):
    return trained(cluster, ["-N2", "--ntasks-per-node=2"], os.path.join(work, "two"), 4)


def check_two_jobs(cluster, work):
    """Two 2-task steps at once on node n1: the ports come from the job ids, both finish."""
    runs = [subprocess.Popen(["srun", "-w", "n1", "-N1", "-n2", "--kill-on-bad-exit=1",
                              sys.executable, *TRAIN, f"--model_dir={work}/both-{i}"],
                             cwd=ROOT, env=cluster.env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in range(2)]
    results = []
    for run in runs:
        try:
            output, _ = run.communicate(timeout=CHECK_TIMEOUT)
        except subprocess.TimeoutExpired:
            for r in runs:
                r.kill()
            raise Failed(f"not both done within {CHECK_TIMEOUT} s")
        results.append((run.returncode, output))
    if any(code != 0 for code, _ in results):
        raise Failed("; ".join(f"exit {code}: {last_line(out)}" for code, out in results))
    return "two 2-task jobs at once on n1, both finished"


TUNE = ["-m", "tfmulti.tune", "--flagfile=flags/tune_smoke.cfg", "--cpu_replicas=1",
        "--max_trials=4"]


# 192 steps, a checkpoint every 20, at the default learning rate: at a high one (--base_lr=2)
# the rounding that differs between 1 and 2 replicas grows to 2e-3 within 32 steps (seen)
LONGER = [a for a in TRAIN if not a.startswith(("--synthetic_train_size", "--epochs",
                                                "--base_lr"))] + [
    "--synthetic_train_size=2048", "--epochs=3", "--deterministic", "--checkpoint_steps=20"]


def started(cluster, name, model_dir, tasks=2, args=LONGER):
    return subprocess.Popen(["srun", "-J", name, "-N1", f"-n{tasks}", "--kill-on-bad-exit=1",
                             sys.executable, *args, f"--model_dir={model_dir}"], cwd=ROOT,
                            env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def task_pids(pattern):
    return subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True,
                          text=True).stdout.split()


def job_id(cluster, name):
    names = subprocess.run(["squeue", "-h", "-o", "%i %j"], env=cluster.env,
                           capture_output=True, text=True).stdout.split()
    return names[names.index(name) - 1]


def first_checkpoint(model_dir, process, step=None, timeout=CHECK_TIMEOUT):
    """Waits for the first checkpoint (or the one of `step`) in model_dir."""
    deadline = time.monotonic() + timeout
    name = f"ckpt-{step}.index" if step else "ckpt-*.index"
    while not glob.glob(os.path.join(model_dir, "checkpoints", name)):
        if process.poll() is not None or time.monotonic() > deadline:
            raise Failed(f"no checkpoint in {model_dir} (srun exit {process.poll()})")
        time.sleep(0.1)


def finished(process, what, timeout=CHECK_TIMEOUT):
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise Failed(f"{what} did not end within {timeout:.0f} s")
    return process.returncode, output


def fingerprints(folder):
    """Each worker's weights fingerprint at the end of the run in `folder` (metrics.json);
    [] when the run has not ended (no fingerprints there yet)."""
    with open(os.path.join(folder, "metrics.json")) as f:
        return json.load(f).get("weights_fingerprints", [])


def check_scancel(cluster, work):
    """scancel mid-epoch: every task saves and exits 75; the same command again resumes and
    ends with the weights of an uninterrupted --deterministic run."""
    whole = started(cluster, "whole", f"{work}/whole")
    victim = started(cluster, "victim", f"{work}/cancelled")
    first_checkpoint(f"{work}/cancelled", victim, step=80)  # in the second epoch (65-128)
    cancelled_at = time.monotonic()
    subprocess.run(["scancel", job_id(cluster, "victim")], env=cluster.env, check=True)
    code, output = finished(victim, "the cancelled step", timeout=60)
    took = time.monotonic() - cancelled_at
    exits = [line for line in output.splitlines() if "Exited with exit code" in line]
    stopped = [line for line in output.splitlines() if "stopped by SIGTERM at step" in line]
    if (code != 75 or len(stopped) != 2 or len(set(stopped)) != 1
            or not all(line.endswith("exit code 75") for line in exits)):
        raise Failed(f"srun exit {code}, tasks: {exits or last_line(output)}, {stopped}")
    step = int(stopped[0].split("at step ")[1].split(",")[0])
    again = started(cluster, "again", f"{work}/cancelled")
    code, resumed = finished(again, "the resumed step")
    if code != 0 or f"at step {step + 1}" not in resumed:
        raise Failed(f"the same command again: exit {code}, {last_line(resumed)}")
    code, _ = finished(whole, "the uninterrupted step")
    if code != 0 or len(set(fingerprints(f"{work}/whole"))) != 1 or fingerprints(
            f"{work}/cancelled") != fingerprints(f"{work}/whole"):
        raise Failed(f"weights {fingerprints(f'{work}/cancelled')} resumed, "
                     f"{fingerprints(f'{work}/whole')} uninterrupted")
    where = "mid-epoch" if step % 64 else "at an epoch's end"
    return (f"both tasks exited 75 {took:.1f} s after scancel at step {step} of 192 ({where}); "
            f"resumed at {step + 1}, weights {fingerprints(f'{work}/cancelled')[0]} "
            "= the uninterrupted run's")


def reference(cluster, work):
    """The uninterrupted --deterministic 2-task run of LONGER (made once): its folder."""
    folder = f"{work}/whole"
    if not os.path.exists(os.path.join(folder, "model.keras")):
        code, output = finished(started(cluster, "whole", folder), "the uninterrupted step")
        if code != 0:
            raise Failed(f"the uninterrupted run: exit {code}, {last_line(output)}")
    return folder


def submitted(cluster, run, *sbatch_args, script=SBATCH, folder="RUN", flags=LONGER[2:],
              variables=None):
    """A batch script (deploy/slurm/train.sbatch, or tune.sbatch with folder="SESSION")
    submitted as a user does (their venv's python first on PATH), its folder variable set
    to run (and `variables`), with `flags` (LONGER's); its job id and output file."""
    out = f"{run}.out"
    env = {**cluster.env, folder: run,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           **(variables or {})}
    result = subprocess.run(["sbatch", "--parsable", "--gpus-per-task=0", "-o", out,
                             *sbatch_args, script, *flags], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise Failed(f"sbatch: {last_line(result.stderr)}")
    return result.stdout.strip().split(";")[0], out


def requeued(cluster, job, out, signalled=False):
    """`scontrol requeue` of the job (or, signalled, SIGTERM to its steps and the script
    requeues itself), waited for until Slurm ran it again to its end: what its output file
    says, and the seconds from the requeue to the end."""
    subprocess.run(["scancel", "--signal=TERM", job] if signalled else
                   ["scontrol", "requeue", job], env=cluster.env, check=True,
                   capture_output=True)
    start = time.monotonic()
    ran_again(cluster, job, REQUEUE_TIMEOUT)
    with open(out) as f:
        return f.read(), time.monotonic() - start


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE")


def ran_again(cluster, job, timeout):
    """Waits until the requeued `job` ran again and ended (scontrol's JobState an end state
    with Restarts at least 1; squeue alone can miss it between its requeue and its start)."""
    deadline = time.monotonic() + timeout
    while True:
        shown = subprocess.run(["scontrol", "-o", "show", "job", job], env=cluster.env,
                               capture_output=True, text=True).stdout
        fields = dict(part.split("=", 1) for part in shown.split() if "=" in part)
        if not shown.strip() or (fields.get("JobState") in ENDED
                                 and int(fields.get("Restarts", "0")) >= 1):
            return
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=cluster.env)
            raise Failed(f"job {job} did not run again to its end within {timeout} s "
                         f"({fields.get('JobState')}, {fields.get('Restarts')} restarts); "
                         "cancelled")
        time.sleep(1)


def gone(cluster, job, timeout):
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", job], env=cluster.env, capture_output=True,
                         text=True).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=cluster.env)
            raise Failed(f"job {job} still queued or running after {timeout} s; cancelled")
        time.sleep(1)


def checkpoint_of(run, step, timeout=CHECK_TIMEOUT):
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(run, "checkpoints", f"ckpt-{step}.index")):
        if time.monotonic() > deadline:
            raise Failed(f"no checkpoint of step {step} in {run} within {timeout} s")
        time.sleep(0.1)


def check_requeue(cluster, work):
    """The sbatch script requeued mid-epoch (as a preemption does): every task saves and
    exits 75, Slurm runs the script again, the run resumes and ends with the weights of the
    uninterrupted run."""
    whole = reference(cluster, work)
    run = f"{work}/requeued"
    job, out = submitted(cluster, run, "-N1", "--ntasks-per-node=2")
    checkpoint_of(run, 80)
    said, took = requeued(cluster, job, out)
    stopped = [line for line in said.splitlines() if "stopped by SIGTERM at step" in line]
    resumed = [line for line in said.splitlines() if line.startswith("Resuming the run")]
    prints = fingerprints(run)
    if len(stopped) != 2 or len(resumed) != 1 or len(set(prints)) != 1:
        raise Failed(f"{len(stopped)} tasks stopped, resumed: {resumed}, weights {prints}")
    if prints != fingerprints(whole):
        raise Failed(f"weights {prints} after the requeue, {fingerprints(whole)} "
                     "uninterrupted")
    return (f"job {job} requeued at {stopped[0].split('at step ')[1].split(',')[0]}: both tasks "
            f"exited 75, the script ran again and ended {took:.0f} s later, "
            f"{resumed[0].split(' at ')[-1]}; weights = the uninterrupted run's")


def check_data_service(cluster, work):
    """train.sbatch with DATA_SERVICE_WORKERS_PER_NODE=1 on 2 nodes: a dispatcher and a
    server per node feed the 2 tasks; requeued mid-run, the servers go on serving while the
    tasks save (--linger), the script runs again with a new service, the run resumes and
    ends, and no server is left."""
    run = f"{work}/served"
    job, out = submitted(cluster, run, "-N2", "--ntasks-per-node=1",
                         variables={"DATA_SERVICE_WORKERS_PER_NODE": "1"})
    checkpoint_of(run, 80)
    said, took = requeued(cluster, job, out)
    lines = said.splitlines()
    served = [line for line in lines if line.startswith("Training batches from the tf.data")]
    workers = [line for line in lines if line.startswith("tf.data service worker")]
    stopped = [line for line in lines if "stopped by SIGTERM at step" in line]
    resumed = [line for line in lines if line.startswith("Resuming the run")]
    lingered = [line for line in lines if line.startswith("SIGTERM: serving 120 s more")]
    after = lines[next((i for i, line in enumerate(lines) if line.startswith("Resuming")), 0):]
    killed = [line for line in after if line.startswith("srun: error")]  # none: all exit 0
    prints = fingerprints(run)
    if not (len(served) == 2 and len(workers) == 4 and len(stopped) == 2 and len(resumed) == 1
            and len(lingered) == 2 and not killed and len(prints) == 2
            and len(set(prints)) == 1):
        raise Failed(f"{len(served)} runs served, {len(workers)} servers said they serve, "
                     f"{len(stopped)} tasks stopped, {len(lingered)} servers lingered, "
                     f"srun's errors after the requeue: {killed}, "
                     f"resumed: {resumed}, weights {prints}; "
                     f"{first_error(said) or last_line(said)}")
    left = subprocess.run(["pgrep", "-f", "tfmulti.dataservice"], capture_output=True,
                          text=True).stdout.split()
    if left:
        raise Failed(f"tf.data service servers left after the job: {left}")
    return (f"{served[0].split(': ')[0]}; requeued at "
            f"{stopped[0].split('at step ')[1].split(',')[0]}, the servers served on while both "
            f"tasks saved, the script ran again with a new service and ended {took:.0f} s "
            f"later, {resumed[0].split(' at ')[-1]}; no server left")


def check_no_dispatcher(cluster, work):
    """train.sbatch with DATA_SERVICE_WORKERS_PER_NODE=1 where the dispatcher cannot start
    (a PATH whose python has no tfmulti): one line, exit 1 well before the 120 s bound, no
    training started, no run folder made."""
    bare = os.path.join(work, "bare")
    os.makedirs(bare, exist_ok=True)
    os.symlink(shutil.which("python3"), os.path.join(bare, "python"))  # the system's: no tfmulti
    run = f"{work}/no_dispatcher"
    start = time.monotonic()
    job, out = submitted(cluster, run, "-N1", "--ntasks-per-node=1",
                         variables={"DATA_SERVICE_WORKERS_PER_NODE": "1",
                                    "PATH": bare + os.pathsep + "/usr/bin:/bin"})
    gone(cluster, job, CHECK_TIMEOUT)
    took = time.monotonic() - start
    code = subprocess.run(["sacct", "-n", "-X", "-j", job, "-o", "ExitCode"], env=cluster.env,
                          capture_output=True, text=True).stdout.strip()
    with open(out) as f:
        said = f.read()
    lines = [line for line in said.splitlines() if line.startswith("train.sbatch:")]
    if (len(lines) != 1 or "dispatcher ended" not in lines[0] or took > 100
            or os.path.exists(run) or "Training" in said):
        raise Failed(f"after {took:.0f} s: {lines or last_line(said)}; run folder made: "
                     f"{os.path.exists(run)}; exit {code or '?'}")
    return lines[0]


def quiet_keras():
    """Keras, TensorFlow's start-up lines held back (as tfmulti's tools import it)."""
    from tfmulti import quiet

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # as tfmulti's tools run it
    quiet.import_tensorflow()
    import keras

    return keras


def check_elastic(cluster, work):
    """The sbatch script on 2 tasks, scancelled mid-epoch, submitted again on 1 task with the
    same RUN: it resumes on 1 worker at the same global batch and ends within float rounding
    of the uninterrupted 2-task run."""
    import numpy as np

    keras = quiet_keras()
    whole = reference(cluster, work)
    run = f"{work}/elastic"
    job, _ = submitted(cluster, run, "-N1", "--ntasks-per-node=2")
    checkpoint_of(run, 80)
    subprocess.run(["scancel", job], env=cluster.env, check=True)
    gone(cluster, job, 60)
    job, out = submitted(cluster, run, "-N1", "--ntasks-per-node=1")
    gone(cluster, job, CHECK_TIMEOUT)
    with open(out) as f:
        said = f.read()
    resumed = [line for line in said.splitlines() if line.startswith("Resuming the run")]
    if not resumed or "on 1 worker, was 2" not in resumed[0]:
        raise Failed(f"not resumed on 1 worker: {resumed or last_line(said)}")
    worst = max(float(np.abs(a - b).max()) for a, b in zip(
        keras.saving.load_model(os.path.join(whole, "model.keras")).get_weights(),
        keras.saving.load_model(os.path.join(run, "model.keras")).get_weights()))
    if worst > 1e-5:
        raise Failed(f"the weights differ from the uninterrupted run's by {worst:.2g}")
    return f"{resumed[0].split(' at ')[-1]}; weights within {worst:.1g} of the uninterrupted run"


def check_kill_task(cluster, work):
    """kill -9 of one task: srun --kill-on-bad-exit ends the step non-zero, no task left."""
    victim = started(cluster, "killed", f"{work}/killed")
    first_checkpoint(f"{work}/killed", victim)
    tasks = [t for t in task_pids(f"--model_dir={work}/killed")
             if "srun" not in open(f"/proc/{t}/cmdline").read()]
    killed_at = time.monotonic()
    os.kill(int(tasks[-1]), signal.SIGKILL)
    code, output = finished(victim, "the step with a killed task", timeout=120)
    took = time.monotonic() - killed_at
    left = [t for t in task_pids(f"--model_dir={work}/killed")
            if "srun" not in open(f"/proc/{t}/cmdline").read()]
    if code == 0 or left:
        raise Failed(f"srun exit {code} after {took:.0f} s; processes left: {left}")
    return (f"one of {len(tasks)} tasks killed: the step ended (srun exit {code}) "
            f"{took:.1f} s later, no task left")


def check_doctor(cluster, work):
    """srun -n2 python -m tfmulti.doctor with a site's port range (TFMULTI_SLURM_PORTS, passed
    by srun to every task): each task prints the cluster it derived from Slurm, on ports of
    that range, warns that the range overlaps the node's ephemeral ports, and checks a real
    all-reduce across the tasks."""
    code, output = cluster.run(["srun", "-N1", "-n2", "--kill-on-bad-exit=1",
                                "--export=ALL,TFMULTI_SLURM_PORTS=40000-40127", sys.executable,
                                "-m", "tfmulti.doctor", "--dataset=synthetic", "--model=lenet",
                                "--num_gpus=0", "--per_replica_batch_size=32",
                                "--doctor_allreduce_mb=1", "--nodoctor_predict"])
    slurm_lines = [x for x in output.splitlines() if "Slurm job " in x and " step " in x]
    ports = {int(p) for x in slurm_lines for p in re.findall(r":(\d+)", x)}
    overlap = [x for x in output.splitlines() if "40000-40127 overlap this node's ephemeral" in x]
    sums = [x for x in output.splitlines() if "across 2 replicas" in x and "sums right" in x]
    if (code != 0 or len(slurm_lines) != 2 or len(sums) != 2 or len(overlap) != 2
            or not ports or not all(40000 <= p <= 40127 for p in ports)):
        raise Failed(f"srun exited {code}: {len(slurm_lines)} slurm lines (ports {sorted(ports)}"
                     f"), {len(overlap)} overlap warnings, {len(sums)} all-reduces summed "
                     f"right: {last_line(output)}")
    return f"{slurm_lines[0].strip()[:110]} | {sums[0].strip()[:60]}"


def tuning_task(session, rank):
    """The pid of task `rank` of the tuning step on `session`, or None."""
    for pid in task_pids(f"--model_dir={session}"):
        try:
            with open(f"/proc/{pid}/environ") as f:
                if f"SLURM_PROCID={rank}\0" in f.read() and "srun" not in open(
                        f"/proc/{pid}/cmdline").read():
                    return int(pid)
        except OSError:
            continue
    return None


def completed_trials(output):
    """The trials the tasks' lines say completed ("chief: trial 2 COMPLETED"), sorted."""
    return sorted(line.split()[2] for line in output.splitlines()
                  if line.startswith(("chief:", "tuner")) and line.endswith(" COMPLETED"))


def check_tune(cluster, work):
    """srun -n3 python -m tfmulti.tune: task 0 serves the search and runs trials, tasks 1 and
    2 run trials. Worker task 1 killed with kill -9 during its trial ends the step
    (--kill-on-bad-exit); the same srun again finishes the session: each of the 4 trials
    completed exactly once."""
    session = os.path.join(work, "tune")
    command = ["srun", "-N1", "-n3", "--kill-on-bad-exit=1", sys.executable, *TUNE,
               f"--model_dir={session}"]
    first = subprocess.Popen(command, cwd=ROOT, env=cluster.env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    oracle = os.path.join(session, "trials", "oracle.json")
    deadline = time.monotonic() + CHECK_TIMEOUT
    while '"tuner1"' not in (open(oracle).read() if os.path.exists(oracle) else ""):
        if first.poll() is not None or time.monotonic() > deadline:
            first.kill()
            said = first.communicate()[0]
            raise Failed(f"task 1 had no trial within {CHECK_TIMEOUT} s (srun exit "
                         f"{first.poll()}): {first_error(said)}")
        time.sleep(0.1)
    victim = tuning_task(session, 1)
    if victim is None:
        first.kill()
        raise Failed("task 1's process was not found")
    os.kill(victim, signal.SIGKILL)
    killed, before = finished(first, "the tuning step with a killed task", timeout=120)
    if killed == 0:
        raise Failed(f"srun exited 0 after a task was killed: {last_line(before)}")
    code, after = cluster.run(command)
    if code != 0:
        raise Failed(f"the rerun exited {code}: {last_line(after)}")
    completed = completed_trials(before + after)
    if completed != ["0", "1", "2", "3"]:
        raise Failed(f"trials completed: {completed}, not 0 to 3 once each")
    by_chief = len([x for x in (before + after).splitlines() if x.startswith("chief: trial")])
    if by_chief == 0:
        raise Failed("task 0 served the search but ran no trial")
    best = next((x for x in after.splitlines() if x.startswith("best:")), "no best line")
    return (f"task 1 killed during its trial: the step ended (srun exit {killed}); rerun: "
            f"trials 0-3 completed once each, {by_chief} by task 0 | {best[:70]}")


def check_your_task(cluster, work):
    """examples/your_task under srun, its modules on PYTHONPATH: the regression on named
    inputs (its own compiled loss and metric) on 2 tasks ends with one weights fingerprint
    and its test mae; the text classifier's tuning session across 2 tasks, task 0 running
    trials too, completes each trial once."""
    env = {"PYTHONPATH": os.path.join(ROOT, "examples", "your_task")}
    model_dir = os.path.join(work, "houses")
    code, output = cluster.run(["srun", "-N1", "-n2", "--kill-on-bad-exit=1", sys.executable,
                                "-m", "tfmulti.main", "--model=my_models:price_regression",
                                "--dataset=my_data:houses", "--global_batch_size=64",
                                "--base_lr=0.4", "--epochs=2", f"--model_dir={model_dir}"],
                               env=env)
    mae = next((x for x in output.splitlines() if x.startswith("test mae:")), "")
    if code != 0 or not mae:
        raise Failed(f"the regression: srun exited {code}: {first_error(output)}")
    prints = fingerprints(model_dir)
    if len(prints) != 2 or len(set(prints)) != 1:
        raise Failed(f"the regression: fingerprints {prints} of 2 tasks")
    code, tuned = cluster.run(["srun", "-N1", "-n2", "--kill-on-bad-exit=1", sys.executable,
                               "-m", "tfmulti.tune", "--model=my_models:tunable_text",
                               "--dataset=my_data:reviews", "--cpu_replicas=1", "--epochs=2",
                               "--max_trials=3", "--tune_batch_sizes=64",
                               f"--model_dir={os.path.join(work, 'tune-reviews')}"], env=env)
    completed = completed_trials(tuned)
    by_chief = [x for x in tuned.splitlines() if x.startswith("chief: trial")]
    best = next((x for x in tuned.splitlines() if x.startswith("best:")), "")
    if code != 0 or completed != ["0", "1", "2"] or not by_chief or not best:
        raise Failed(f"the text session: srun exited {code}, trials completed {completed}, "
                     f"{len(by_chief)} by task 0: {first_error(tuned)}")
    return (f"regression on 2 tasks: one fingerprint, {mae[:40]} | text session on 2 tasks: "
            f"3 trials, {len(by_chief)} by task 0, {best[:50]}")


def check_tune_requeue(cluster, work, signalled=False):
    """deploy/slurm/tune.sbatch on 2 tasks (both run trials) requeued while trials train, as
    a preemption does: each task's trial saves a checkpoint and the task exits 75, Slurm runs
    the script again, and the session ends with each of its 4 trials completed once.
    signalled: SIGTERM to the job's steps instead (`scancel --signal=TERM`, what the script's
    --signal=TERM@180 sends before the time limit): the tasks exit 75 and the script's own
    last line requeues the job."""
    session = f"{work}/tune-{'signalled' if signalled else 'requeued'}"
    job, out = submitted(cluster, session, "-N1", "--ntasks-per-node=2", script=TUNE_SBATCH,
                         folder="SESSION", flags=TUNE[2:])
    deadline = time.monotonic() + CHECK_TIMEOUT
    pattern = os.path.join(session, "trials", "trial_*", "run", "checkpoints", "ckpt-*.index")
    while len({os.path.dirname(p) for p in glob.glob(pattern)}) < 2:  # both tasks in a trial
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=cluster.env)
            raise Failed(f"no two trials with a checkpoint within {CHECK_TIMEOUT} s")
        time.sleep(0.1)
    said, took = requeued(cluster, job, out, signalled)
    stopped = [x for x in said.splitlines() if "tuning stopped by SIGTERM" in x]
    completed = completed_trials(said)
    best = next((x for x in said.splitlines() if x.startswith("best:")), "")
    table = os.path.join(session, "trials.csv")
    if not os.path.exists(table):
        raise Failed(f"the session did not end (no trials.csv); the job said: {last_line(said)}")
    with open(table) as f:
        rows = f.read().count("COMPLETED")
    if len(stopped) != 2 or completed != ["0", "1", "2", "3"] or not best or rows != 4:
        raise Failed(f"{len(stopped)} tasks stopped by SIGTERM, trials completed {completed}, "
                     f"{rows} in trials.csv: {last_line(said)}")
    return (f"job {job} requeued: {stopped[0].split('tuning ')[1].split(';')[0]} (and the "
            f"other task), the script ran again and ended {took:.0f} s later; "
            f"trials 0-3 completed once each | {best[:60]}")


def check_no_step(cluster, work):
    """An sbatch script that starts tfmulti without srun: one line, non-zero."""
    script = os.path.join(work, "no_step.sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/bash\n#SBATCH -n 2\ncd {ROOT}\n{sys.executable} {' '.join(TRAIN)} "
                f"--model_dir={work}/no_step\n")
    out = os.path.join(work, "no_step.out")
    code, output = cluster.run(["sbatch", "--wait", "-o", out, script])
    with open(out) as f:
        said = f.read()
    if code == 0 or "not a task of a job step: start the command with srun" not in last_line(said):
        raise Failed(f"sbatch exited {code}: {last_line(said)}")
    return last_line(said)


def check_indivisible(cluster, work):
    """srun -n3 with a global batch of 32: one line from each task, non-zero."""
    code, output = cluster.run(["srun", "-N1", "-n3", "--kill-on-bad-exit=1", sys.executable,
                                *TRAIN, f"--model_dir={work}/three"])
    errors = {line for line in output.splitlines() if line.startswith("tfmulti: error:")}
    if code == 0 or len(errors) != 1 or "does not divide over 3 replicas" not in next(iter(errors)):
        raise Failed(f"srun exited {code}: {sorted(errors) or last_line(output)}")
    return next(iter(errors))


def check_port_taken(cluster, work):
    """Task 0's port held by another process: the tasks stop with one line each, non-zero,
    instead of sharing the port (gRPC's SO_REUSEPORT) with whatever holds it."""
    import socket

    from tfmulti.distribution import slurm

    script = os.path.join(work, "port.sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/bash\n#SBATCH -N1 -n2\ncd {ROOT}\nsrun --kill-on-bad-exit=1 "
                f"{sys.executable} {' '.join(TRAIN)} --model_dir={work}/port\n")
    out = os.path.join(work, "port.out")
    result = subprocess.run(["sbatch", "--parsable", "--hold", "-o", out, script],
                            env=cluster.env, capture_output=True, text=True, check=True)
    job = result.stdout.strip().split(";")[0]
    ours = slurm.cluster({"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
                          "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2"})
    port = int(ours["cluster"]["worker"][0].rsplit(":", 1)[1])
    with socket.socket() as holder:
        holder.bind(("", port))
        holder.listen()
        subprocess.run(["scontrol", "release", job], env=cluster.env, check=True,
                       capture_output=True)
        gone(cluster, job, CHECK_TIMEOUT)
    with open(out) as f:
        said = f.read()
    refusals = {line for line in said.splitlines() if line.startswith("tfmulti: error: port")}
    if len(refusals) != 1 or f"port {port} of this worker" not in next(iter(refusals)):
        raise Failed(f"with port {port} held: {sorted(refusals) or last_line(said)}")
    return next(iter(refusals))


CHECK_FUNCTIONS = {"port_taken": check_port_taken, "one_node": check_one_node,
                   "two_nodes": check_two_nodes, "two_jobs": check_two_jobs,
                   "doctor": check_doctor, "tune": check_tune,
                   "tune_requeue": check_tune_requeue,
                   "tune_timelimit": lambda c, w: check_tune_requeue(c, w, signalled=True),
                   "your_task": check_your_task,
                   "scancel": check_scancel,
                   "kill_task": check_kill_task, "requeue": check_requeue,
                   "elastic": check_elastic, "no_step": check_no_step,
                   "indivisible": check_indivisible, "data_service": check_data_service,
                   "no_dispatcher": check_no_dispatcher}


# --- main -----------------------------------------------------------------------------------

def install_packages():
    missing = [p for p in ("slurmctld", "slurmd", "srun", "munged") if not shutil.which(p)]
    if not missing:
        return "slurmctld, slurmd, srun and munged installed"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    result = subprocess.run(["apt-get", "install", "-y", "-qq", *PACKAGES], env=env,
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
        result = subprocess.run(["apt-get", "install", "-y", "-qq", *PACKAGES], env=env,
                                capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise Failed(f"apt-get install {' '.join(PACKAGES)} failed: {last_line(result.stderr)}")
    return f"installed {' '.join(PACKAGES)}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated, of {', '.join(CHECKS)}")
    args = parser.parse_args(argv)
    checks = args.checks.split(",")
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    if os.geteuid() != 0:
        print("cluster-test: needs root (it installs Slurm and starts its daemons)")
        return 1
    start = time.monotonic()
    if step("packages", install_packages) is None:
        return 1
    cluster, failed = Cluster(), []
    try:
        if step("daemons", cluster.start) is None:
            return 1
        work = tempfile.mkdtemp(prefix="tfmulti-cluster-runs-")
        try:
            for name in checks:
                if step(name, CHECK_FUNCTIONS[name], cluster, work) is None:
                    failed.append(name)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        step("stop", cluster.stop)
    total = len(checks)
    say(not failed, "cluster-test", f"{total - len(failed)}/{total} checks passed in "
        f"{time.monotonic() - start:.0f} s" + (f" (failed: {', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
