"""The records' kept index against the indexing pass: how long loading TFRecord shards takes
before a run can start, the first time (every record read through, its checksum checked and
its target parsed) and when the index of each file is kept from an earlier run.

    python benchmarks/recordindex.py --out=benchmarks/results/recordindex.json   # ~3 minutes

--records records of 32x32x3 raw pixels (3 KB each) in --shards TFRecord shards with a parse
function (as benchmarks/ondisk.py writes them), in a temporary folder. Each round loads them
in two fresh processes (`sources.load("tfrecord:...", parse=...)`, TensorFlow's import not
counted): the first with an empty cache, the second with the index the first kept. The files
sit in the page cache after they are written, so the pass reads from memory here: from a
disk or a network file system it takes longer, and the kept index does not change.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ondisk import PARSE  # noqa: E402
from yourmodel import save  # noqa: E402

LOAD = textwrap.dedent('''
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from tfmulti.data import sources
    start = time.perf_counter()
    dataset = sources.load(sys.argv[2], parse="my_records:parse")
    print("SECONDS", time.perf_counter() - start, len(dataset.train_targets), flush=True)
''')


def write_shards(folder, records, shards):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    for split, count in (("train", records), ("test", max(1, records // 10))):
        parts = np.array_split(np.arange(count), shards if split == "train" else 1)
        for i, part in enumerate(parts):
            path = os.path.join(folder, f"{split}-{i:05d}-of-{len(parts):05d}")
            with tf.io.TFRecordWriter(path) as writer:
                for _ in part:
                    image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                    writer.write(tf.train.Example(features=tf.train.Features(feature={
                        "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                            value=[image.tobytes()])),
                        "label": tf.train.Feature(int64_list=tf.train.Int64List(
                            value=[int(rng.integers(0, 3))])),
                    })).SerializeToString())
    with open(os.path.join(folder, "my_records.py"), "w") as f:
        f.write(PARSE)


def load_seconds(folder, cache):
    spec = f"tfrecord:{folder}/train-*,{folder}/test-*"
    done = subprocess.run([sys.executable, "-c", LOAD, folder, spec], cwd=ROOT,
                          env={**os.environ, "XDG_CACHE_HOME": cache}, capture_output=True,
                          text=True, timeout=1800)
    if "SECONDS" not in done.stdout:
        raise SystemExit(done.stderr.strip().splitlines()[-1:])
    return float(done.stdout.split("SECONDS", 1)[1].split()[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=60000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results",
                                                      "recordindex.json"))
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="tfmulti-recordindex-")
    write_shards(folder, args.records, args.shards)
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
    runs = []
    for r in range(args.rounds):
        cache = tempfile.mkdtemp(prefix="tfmulti-recordindex-cache-")
        first, kept = load_seconds(folder, cache), load_seconds(folder, cache)
        runs.append({"round": r + 1, "index_pass_s": first, "kept_index_s": kept})
        print(f"round {r + 1}: indexing pass {first:.2f} s, kept index {kept:.2f} s",
              flush=True)
    first = statistics.median(r["index_pass_s"] for r in runs)
    kept = statistics.median(r["kept_index_s"] for r in runs)
    save(args, "recordindex.py", {"records": args.records, "megabytes": size / 2**20,
                                  "index_pass_s_median": first, "kept_index_s_median": kept,
                                  "speedup": first / kept}, runs)


if __name__ == "__main__":
    main()
