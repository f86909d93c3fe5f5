"""Data once: examples that stay in files (a folder, records read by index) are decoded once
into memory where they fit, since decoding every epoch takes the cores that also compute (a
run's that do not fit: into a file, ondisk.py). The order is the same either way, so a run
may resume in another mode."""
from __future__ import annotations

import dataclasses
import os
import resource
import time
from typing import TYPE_CHECKING

import numpy as np

from tfmulti.decoded import ondisk

if TYPE_CHECKING:
    from tfmulti.data.dataset import DataSet

MEMORY_SHARE = 0.25  # of the memory this process may use that decoded examples may take
CGROUP_ROOT = "/sys/fs/cgroup"


def memory_bytes(cgroups: str = "/proc/self/cgroup", root: str = CGROUP_ROOT) -> int:
    """The memory this process may use: the machine's, or less where its cgroup or one
    above it (a container, a Slurm job; v1 or v2) or an address-space limit says so."""
    limits = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    for folder, name in _cgroup_folders(cgroups, root):
        while True:  # this cgroup and every one above it
            try:
                with open(os.path.join(folder, name)) as f:
                    text = f.read().strip()
                limits += [int(text)] if text.isdigit() else []
            except OSError:
                pass
            if os.path.normpath(folder) in (os.path.normpath(root), "/"):
                break
            folder = os.path.dirname(folder)
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        limits.append(soft)
    return min(limits)


def _cgroup_folders(cgroups, root):
    """[(folder, limit file)] of this process's memory cgroups: v2 (0::PATH) and v1
    (N:memory:PATH, or N:...,memory,...:PATH)."""
    try:
        with open(cgroups) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and not controllers:
            found.append((os.path.join(root, path.lstrip("/")), "memory.max"))
        elif "memory" in controllers.split(","):
            found.append((os.path.join(root, "memory", path.lstrip("/")),
                          "memory.limit_in_bytes"))
    return found


def decode_once(dataset: DataSet, on: bool, copies: int, reader: str = "every trial"
                ) -> tuple[bool, str]:
    """(whether to decode, the line saying so): not with --nodecode_once (on False), nor where
    `copies` (2 for a run, 1 + 2 x trials at once for a session) would pass MEMORY_SHARE of
    memory_bytes(). reader: who reads them. Data in memory already: (False, "")."""
    features = dataset.train_features
    if not (hasattr(features, "read_batch") or hasattr(features, "gather_batch")):
        return False, ""  # not folder.ImageFiles or records.Records
    word = dataset.example_word
    if not on:
        return False, f"{word} read from their files by {reader} (--nodecode_once)"
    size = int(np.prod(features.shape)) * features.dtype.itemsize * copies
    memory = memory_bytes()
    if size > MEMORY_SHARE * memory:
        return False, (f"{word} read from their files by {reader}: decoded, they would "
                       f"take {size / 2**20:.1f} MB with {reader}'s copies, more than "
                       f"{MEMORY_SHARE:.0%} of the {memory / 2**30:.1f} GB of memory this "
                       "process may use")
    return True, (f"{len(features)} training {word} decoded once; {reader} reads them from "
                  "memory")


def decoded(dataset: DataSet, prepared: str, verbose: bool = True) -> np.ndarray:
    """The training images (or examples) as one array, decoded, said."""
    start = time.perf_counter()
    examples = np.asarray(dataset.train_features)
    if verbose:
        print(f"{dataset.display_name}: {prepared} ({examples.nbytes / 2**20:.0f} MB, decoded "
              f"in {time.perf_counter() - start:.1f} s)", flush=True)
    return examples


def for_run(dataset: DataSet, on: bool, verbose: bool) -> DataSet:
    """The data set of a run on one worker: its training examples decoded into memory when
    they stay in files and fit (decode_once), else into a file of the cache that the run maps
    into memory (ondisk.py) where the disk has room; its reading line says which."""
    decode, said = decode_once(dataset, on, copies=2, reader="the run")
    if not said:
        return dataset
    if not decode:
        return onto_disk(dataset, said, verbose) if on else read_from_files(dataset, said)
    return dataclasses.replace(dataset, train_features=decoded(dataset, said, verbose),
                               reading="")


def onto_disk(dataset: DataSet, said: str, verbose: bool, reader: str = "the run"
              ) -> DataSet:
    """The data set with its training examples, too many for memory (`said` says so),
    decoded once into a file of the cache and mapped (said when verbose: `reader` reads
    them); where the disk has no room for them, as it is, reading its files (and saying why
    in its reading line)."""
    mapped, line = ondisk.decoded_file(dataset, reader)
    if mapped is None:
        return read_from_files(dataset, f"{said}; nor onto disk: {line}")
    if verbose:
        print(f"{dataset.display_name}: {line}", flush=True)
    return dataclasses.replace(dataset, train_features=mapped, reading="")


def read_from_files(dataset: DataSet, said: str) -> DataSet:
    """The data set reading its files, `said` (why) added to its reading line."""
    return dataclasses.replace(dataset, reading=f"{dataset.reading}; {said}"
                               if dataset.reading else f"--dataset={dataset.name}: {said}")
