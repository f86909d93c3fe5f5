"""A tf.data service server for --data_service: the dispatcher, or one of its workers.

    python -m tfmulti.dataservice dispatcher --port=5050 --trusted_network
    python -m tfmulti.dataservice worker --dispatcher=data-node:5050 --trusted_network

The workers read and decode the training batches of `python -m tfmulti.main
--data_service=data-node:5050` and send them to its workers; they must reach the data at the
paths the training job names. Each server runs until SIGTERM or Ctrl-C (exit 0). It runs any
dataset whoever reaches its port sends it: run it where only the training machines reach it;
without --trusted_network it refuses to start.
The tool is tfmulti/tools/dataservice.py.
"""
from tfmulti import cli

if __name__ == "__main__":
    cli.main("dataservice")
