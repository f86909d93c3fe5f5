"""`make cluster-test`: a real Slurm on this machine, and tfmulti run on it as users run it.

    sudo .venv/bin/python cluster/run.py [--checks=one_node,two_nodes,...]

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
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness.steps import Failed, say, step  # noqa: E402
PACKAGES = ("slurmd", "slurmctld", "slurm-client", "munge")
NODES = ("n1", "n2")
HOSTS_LINE = "127.0.0.1 n1 n2  # tfmulti cluster-test"
CHECKS = ("one_node", "two_nodes", "two_jobs", "no_step", "indivisible")
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
        from tfmulti.distribution.launcher import free_ports

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
        left = subprocess.run(["pgrep", "-f", "tfmulti.main"], capture_output=True, text=True)
        return ("every daemon stopped, /etc/hosts and the folder restored"
                + (f"; tfmulti processes left: {left.stdout.split()}" if left.stdout else ""))

    def run(self, command, timeout=CHECK_TIMEOUT):
        """(exit code, output) of a Slurm command, stopped at its time limit."""
        try:
            result = subprocess.run(command, cwd=ROOT, env=self.env, capture_output=True,
                                    text=True, timeout=timeout)
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
    prints = [line.split()[-1] for line in output.splitlines() if "weights fingerprint" in line]
    if len(prints) != tasks or len(set(prints)) != 1:
        raise Failed(f"{len(prints)} fingerprints for {tasks} tasks: {sorted(set(prints))}")
    with open(os.path.join(model_dir, "metrics.json")) as f:
        workers = json.load(f)["workers"]
    if workers != tasks:
        raise Failed(f"the report counts {workers} workers, not {tasks}")
    line = next((x for x in output.splitlines() if x.startswith("test acc:")), "no test acc line")
    return f"{tasks} tasks, one weights fingerprint {prints[0]}, report: {workers} workers | {line[:80]}"


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


CHECK_FUNCTIONS = {"one_node": check_one_node, "two_nodes": check_two_nodes,
                   "two_jobs": check_two_jobs, "no_step": check_no_step,
                   "indivisible": check_indivisible}


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
