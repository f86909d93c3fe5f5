"""Data that stays on disk against the same examples in memory: a folder of images, TFRecord
shards with a parse function, and a tensorflow-datasets set prepared as TFRecord and as
ArrayRecord (the last three read by index); the tfds set decoded once into memory, as
the main job does where the decoded examples fit (`tfds_decoded_once`); and the folder and
the tfds set decoded once into a file of the cache mapped into memory, as it does where they
do not (`*_decoded_to_disk`, the memory made too small for them).

    python benchmarks/ondisk.py --out=benchmarks/results/ondisk.json   # ~15 minutes, 2 cores

The images are examples/your_project's `shapes` (3000 + 600 RGB images of 32x32, 3 classes),
written once into a temporary folder in each form: PNG files in DIR/train/<class>/, 4
TFRecord shards of raw pixels, and a tensorflow-datasets builder's files (PNG-encoded, its
Image feature) in both formats. Every source but `tfds_decoded_once` is read from its files
each epoch (the engine called as with --nodecode_once). The engine trains the project's
`small_cnn` on them on 2 logical CPU replicas, global batch 64, for --epochs epochs, each
source in a process of its own, the order rotating over --rounds.

Speed: the training images per second of every epoch after the first, median per source;
each ratio is of medians from this one invocation, against `memory` (`my_data:shapes`); and
the share of each epoch its steps waited for their input (the run's own input_wait_share).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = os.path.join(ROOT, "examples", "your_project")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from folder import write_folder  # noqa: E402
from yourmodel import GLOBAL_BATCH, LEARNING_RATE, MOMENTUM, REPLICAS, save  # noqa: E402

SHARDS = 4
PARSE = textwrap.dedent('''
    import tensorflow as tf

    FEATURES = {"image": tf.io.FixedLenFeature([], tf.string),
                "label": tf.io.FixedLenFeature([], tf.int64)}


    def parse(serialized):
        example = tf.io.parse_single_example(serialized, FEATURES)
        image = tf.reshape(tf.io.decode_raw(example["image"], tf.uint8), [32, 32, 3])
        return image, example["label"]
''')
BUILDER = textwrap.dedent('''
    import sys

    import tensorflow_datasets as tfds

    sys.path.insert(0, {project!r})


    class Shapes(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({{
                "image": tfds.features.Image(shape=(32, 32, 3)),
                "label": tfds.features.ClassLabel(num_classes=3)}}),
                supervised_keys=("image", "label"))

        def _split_generators(self, dl_manager):
            import my_data

            (x, y), (tx, ty), _ = my_data.shapes()
            return {{"train": self._generate_examples(x, y),
                     "test": self._generate_examples(tx, ty)}}

        def _generate_examples(self, images, labels):
            for i, (image, label) in enumerate(zip(images, labels)):
                yield i, {{"image": image, "label": int(label)}}
''')


def write_records(root):
    """shapes as TFRecord shards root/records/{train,test}-0000i with my_records.parse."""
    sys.path.insert(0, PROJECT)
    import my_data
    import numpy as np
    import tensorflow as tf

    (x, y), (tx, ty), _ = my_data.shapes()
    folder = os.path.join(root, "records")
    os.makedirs(folder)
    for split, images, labels, shards in (("train", x, y, SHARDS), ("test", tx, ty, 1)):
        for i, part in enumerate(np.array_split(np.arange(len(images)), shards)):
            with tf.io.TFRecordWriter(os.path.join(folder, f"{split}-{i:05d}")) as writer:
                for index in part:
                    writer.write(tf.train.Example(features=tf.train.Features(feature={
                        "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                            value=[images[index].tobytes()])),
                        "label": tf.train.Feature(int64_list=tf.train.Int64List(
                            value=[int(labels[index])]))})).SerializeToString())
    with open(os.path.join(folder, "my_records.py"), "w") as f:
        f.write(PARSE)
    return folder


def prepare_tfds(root):
    """shapes prepared by tensorflow-datasets in root/tfds_{tfrecord,array_record}."""
    with open(os.path.join(root, "shapes_builder.py"), "w") as f:
        f.write(BUILDER.format(project=PROJECT))
    subprocess.run([sys.executable, "-c", "import shapes_builder as b\n"
                    "b.Shapes(data_dir='tfds_tfrecord').download_and_prepare()\n"
                    "b.Shapes(data_dir='tfds_array_record', file_format='array_record')"
                    ".download_and_prepare()"], cwd=root, check=True, capture_output=True)


def engine(epochs, dataset, parse, data_dir, once, mapped=False):
    """The engine on `dataset` in this process (once: its training examples decoded into
    memory first, as the main job does where they fit; mapped: into a file of the cache
    mapped into memory, as it does where they do not): images/s of each epoch."""
    sys.path.insert(0, PROJECT)
    from tfmulti.data import sources
    from tfmulti.distribution import startup
    from tfmulti.run.config import RunConfig
    from tfmulti.training import train

    cfg = RunConfig(model="my_models:small_cnn", dataset=dataset, cpu_replicas=REPLICAS,
                    global_batch_size=GLOBAL_BATCH, base_lr=LEARNING_RATE * 256 / GLOBAL_BATCH,
                    momentum=MOMENTUM, epochs=epochs, parse=parse, data_dir=data_dir)
    strategy = startup.from_config(cfg).start()
    data = sources.load_for(cfg)
    if once or mapped:
        import numpy as np

        from tfmulti.decoded import dataonce, ondisk

        if mapped:  # as if memory were too small for them
            dataonce.MEMORY_SHARE = 1e-12
        data = dataonce.for_run(data, True, verbose=False)
        kind = ondisk.MappedExamples if mapped else np.ndarray
        assert isinstance(data.train_features, kind), "not decoded where asked"
    _, history = train.train_and_evaluate(strategy, data, cfg, verbose=0)
    return [(r["images_per_sec"], r["input_wait_share"]) for r in history]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "ondisk.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--parse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--data_dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mapped", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(engine(args.epochs, args.child, args.parse, args.data_dir,
                                            args.once, args.mapped)))
        return
    names = ("memory", "folder", "tfrecord", "tfds_tfrecord", "tfds_array_record",
             "tfds_decoded_once", "folder_decoded_to_disk", "tfds_decoded_to_disk")
    runs = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="tfmulti-ondisk-bench-") as root:
        files = write_folder(os.path.join(root, "folder"))
        records = write_records(root)
        prepare_tfds(root)
        sources = {
            "memory": ["--child=my_data:shapes"],
            "folder": [f"--child=folder:{root}/folder"],
            "tfrecord": [f"--child=tfrecord:{records}/train-*,{records}/test-*",
                         "--parse=my_records:parse"],
            "tfds_tfrecord": ["--child=tfds:shapes", f"--data_dir={root}/tfds_tfrecord"],
            "tfds_array_record": ["--child=tfds:shapes",
                                  f"--data_dir={root}/tfds_array_record"],
            "tfds_decoded_once": ["--child=tfds:shapes", f"--data_dir={root}/tfds_tfrecord",
                                  "--once"],
            "folder_decoded_to_disk": [f"--child=folder:{root}/folder", "--mapped"],
            "tfds_decoded_to_disk": ["--child=tfds:shapes", f"--data_dir={root}/tfds_tfrecord",
                                     "--mapped"]}
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for source in order:
                out = subprocess.run([sys.executable, __file__, f"--epochs={args.epochs}",
                                      *sources[source]], cwd=root, capture_output=True,
                                     text=True,
                                     env={**os.environ, "PYTHONPATH": f"{ROOT}:{records}",
                                          "XDG_CACHE_HOME": os.path.join(root, "cache")})
                line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                if out.returncode != 0 or not line:
                    sys.exit(f"{source} failed:\n{out.stderr[-3000:]}")
                rates = json.loads(line[0][len("RESULT "):])
                runs[source].append(rates)
                print(f"round {round_ + 1} {source:>17}: "
                      f"{statistics.median(r for r, _ in rates[1:]):7.0f} images/s, waiting "
                      f"for input {statistics.median(w for _, w in rates[1:]):.1%}", flush=True)
    medians = {source: statistics.median(r for run in results for r, _ in run[1:])
               for source, results in runs.items()}
    summary = {"images_per_sec_median": medians,
               "ratio_over_memory": {source: medians[source] / medians["memory"]
                                     for source in names[1:]},
               "input_wait_share_median": {
                   source: statistics.median(w for run in results for _, w in run[1:])
                   for source, results in runs.items()},
               "train_examples": files}
    save(args, "ondisk.py", summary, runs)


if __name__ == "__main__":
    main()
