"""How long the check before a run takes on a folder of many image files: every file's header
read (for its pixel count) and every file decoded, in parallel, the first that does not decode
named.

    python benchmarks/foldercheck.py --out=benchmarks/results/foldercheck.json   # ~3 minutes

Writes --files PNG images (28x28 gray, 10 classes, the synthetic set's) into a temporary
DIR/train/<class>/ (and a tenth as many in DIR/test/), then times, --repeats times each,
sources.load("folder:DIR"): listing, header checks and decoding of every file, as a run does
before its first step. Then it spoils one training file in the middle and times the check
that names it. The files are in the page cache (just written): a cold disk adds its read
time.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from yourmodel import save  # noqa: E402


def write_pngs(root, count, seed):
    """count PNG files of the synthetic set in root/<class>/, encoded in parallel."""
    import tensorflow as tf

    from tfmulti.data import synthetic

    (x, y), _ = synthetic.make_dataset(count, 1, seed)
    for label in range(10):
        os.makedirs(os.path.join(root, f"class{label}"), exist_ok=True)
    paths = [os.path.join(root, f"class{label}", f"{i:06d}.png") for i, label in enumerate(y)]
    def write(image, path):
        with tf.control_dependencies([tf.io.write_file(path, tf.io.encode_png(image))]):
            return tf.identity(path)

    data = tf.data.Dataset.from_tensor_slices((x[..., None], paths)).map(
        write, num_parallel_calls=tf.data.AUTOTUNE)
    for _ in data:
        pass
    return paths


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=100000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results",
                                                      "foldercheck.json"))
    args = parser.parse_args()
    from tfmulti.data import sources
    from tfmulti.errors import DataError

    runs = {"check_seconds": [], "spoiled_check_seconds": []}
    with tempfile.TemporaryDirectory(prefix="tfmulti-foldercheck-") as root:
        start = time.perf_counter()
        paths = write_pngs(os.path.join(root, "train"), args.files, 0)
        write_pngs(os.path.join(root, "test"), max(args.files // 10, 10), 1)
        written = time.perf_counter() - start
        print(f"wrote {args.files} + {max(args.files // 10, 10)} files in {written:.0f} s",
              flush=True)
        for _ in range(args.repeats):
            start = time.perf_counter()
            dataset = sources.load(f"folder:{root}")
            runs["check_seconds"].append(time.perf_counter() - start)
            assert dataset.train_size == args.files
            print(f"check: {runs['check_seconds'][-1]:.1f} s", flush=True)
        victim = sorted(paths)[len(paths) // 2]
        with open(victim, "r+b") as f:
            f.seek(40)
            f.write(b"\0" * 64)  # inside the image data: the header still reads
        for _ in range(args.repeats):
            start = time.perf_counter()
            try:
                sources.load(f"folder:{root}")
                sys.exit("the spoiled file was not found")
            except DataError as e:
                said = str(e)
            runs["spoiled_check_seconds"].append(time.perf_counter() - start)
            assert os.path.basename(victim) in said, said
            said = said.replace(root, "DIR")
            print(f"spoiled: {runs['spoiled_check_seconds'][-1]:.1f} s: {said}", flush=True)
    summary = {name: statistics.median(values) for name, values in runs.items()}
    summary.update(files=args.files, test_files=max(args.files // 10, 10),
                   files_per_second=(args.files + max(args.files // 10, 10))
                   / summary["check_seconds"],
                   named=said.split(": ", 1)[1][:200])
    save(args, "foldercheck.py", summary, runs)


if __name__ == "__main__":
    main()
