"""The tf.data service's servers (`python -m tfmulti.dataservice dispatcher|worker`): the
dispatcher, which deals the training jobs' batches to its workers, and a worker, which makes
them. Each says in one line where it listens, then serves until SIGTERM or Ctrl-C, and then
exits with code 0, at once or, after SIGTERM, --linger seconds later: TensorFlow's servers are
not shut down (stopping a dispatcher has crashed TensorFlow 2.21 at exit, tensorflow#113163),
the process simply ends."""
import os
import signal
import socket
import sys
import threading

import tensorflow as tf

from tfmulti.errors import UsageError
from tfmulti.run import config, flagdefs

COMMANDS = ("dispatcher", "worker")
UNTRUSTED = ("a tf.data service server listens on every interface of this machine and runs "
             "whatever dataset whoever reaches its port sends it, as you (TensorFlow's servers "
             "have no authentication): start it on a network your training machines alone "
             "reach, with --trusted_network (tfmulti.launch --data_service_workers=N starts "
             "the servers in its workers' own network)")


def main(command):
    FLAGS = flagdefs.FLAGS
    if not 0 <= FLAGS.port < 65536:
        raise UsageError(f"--port={FLAGS.port}: give a port, 0 to 65535")
    if not 0 <= FLAGS.linger < float("inf"):
        raise UsageError(f"--linger={FLAGS.linger:g}: give seconds, 0 or more")
    if command == "dispatcher" and (FLAGS.dispatcher or FLAGS.advertise):
        raise UsageError("--dispatcher and --advertise are a worker's")
    if command == "worker" and not FLAGS.dispatcher:
        raise UsageError("a worker needs --dispatcher=HOST:PORT")
    if not FLAGS.trusted_network:
        raise UsageError(UNTRUSTED)
    stopped = stop_on_signals(FLAGS.linger)
    service = tf.data.experimental.service
    if command == "dispatcher":
        server = service.DispatchServer(service.DispatcherConfig(port=FLAGS.port))
        said = f"tf.data service dispatcher listening on port {port_of(server.target)}"
    else:
        dispatcher = config.host_port(config.service_address(FLAGS.dispatcher))
        host = FLAGS.advertise or socket.gethostname()
        server = service.WorkerServer(service.WorkerConfig(
            dispatcher_address=dispatcher, worker_address=f"{host}:%port%", port=FLAGS.port))
        said = (f"tf.data service worker {host}:{port_of(server._address)} serving for "
                f"{dispatcher}")
    print(f"{said} (every interface, no authentication: --trusted_network)", flush=True)
    ended(stopped)


def stop_on_signals(linger: float = 0.0) -> threading.Event:
    """An event set by SIGINT, or `linger` seconds after SIGTERM (at once when 0), each then
    ending the process with exit code 0 (ended()); installed before the server says it
    serves, so a signal right after that line is never the default one's death."""
    stopped = threading.Event()
    ends = []

    def on_signal(signum, _):
        if signum == signal.SIGTERM and linger and not ends:
            ends.append(True)
            print(f"SIGTERM: serving {linger:g} s more", flush=True)
            timer = threading.Timer(linger, stopped.set)
            timer.daemon = True
            timer.start()
        else:
            stopped.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    return stopped


def port_of(target):
    return target.rsplit(":", 1)[-1]


def ended(stopped: threading.Event) -> None:
    """Waits (the servers run in TensorFlow's threads) until `stopped` is set, then ends the
    process, exit code 0."""
    while not stopped.wait(0.2):
        pass
    print("stopped", flush=True)
    sys.stderr.flush()
    os._exit(0)
