"""Data once: a tuning session on a folder of images, or on records read from their files
(tfds:NAME, tfrecord:), decodes its training examples once, so that its trials read them
from memory instead of reading and decoding every file each epoch, when the decoded examples
fit (decode_once); otherwise, and with --nodecode_once, every trial reads the files. Other
data sets are in memory already."""
import os
import time

import numpy as np

MEMORY_SHARE = 0.25  # of the machine's memory that a session's decoded images may take


def decode_once(dataset, on, at_once=1):
    """(whether to decode, a line saying how the trials read the data): a folder's training
    images are decoded once (decoded()), so that its trials read them from memory instead of
    decoding every file each epoch; not with --nodecode_once, or when the decoded images,
    once in the session's process and twice (the array and the pipeline's tensor) in each
    of the `at_once` trial processes, would pass MEMORY_SHARE of the machine's memory.
    Other sets are in memory already: (False, "")."""
    features = dataset.train_features
    if not (hasattr(features, "read_batch") or hasattr(features, "gather_batch")):
        return False, ""  # not folder.ImageFiles or records.Records
    word = dataset.example_word
    if not on:
        return False, f"{word} read from their files by every trial (--nodecode_once)"
    size = int(np.prod(features.shape)) * (1 + 2 * at_once)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if size > MEMORY_SHARE * memory:
        return False, (f"{word} read from their files by every trial: decoded, they would "
                       f"take {size / 2**20:.1f} MB with the trials' copies, more than "
                       f"{MEMORY_SHARE:.0%} of this machine's memory")
    return True, (f"{len(features)} training {word} decoded once; the trials read them from "
                  "memory")


def decoded(dataset, prepared):
    """The training images (or examples) as one array, decoded, said."""
    start = time.perf_counter()
    images = np.asarray(dataset.train_features)
    print(f"{dataset.display_name}: {prepared} ({images.nbytes / 2**20:.0f} MB, decoded in "
          f"{time.perf_counter() - start:.1f} s)", flush=True)
    return images
