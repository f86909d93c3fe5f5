"""The sources --dataset can name, one entry each: how its value is written and checked, what a
run folder is called after it, and what it means for the rest of the settings (named splits,
--parse, features as your function returns them). The module that reads a source's examples
is named here, not imported: this table is read before TensorFlow starts (the flags are
checked first), and a source's module imports it.

A new source is one module (in tfmulti/data/) with `load(spec, request) -> DataSet` and one
entry in SOURCES (docs/developing.md works one through).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from tfmulti.errors import UsageError
from tfmulti.run.usercode import SPEC

BUILT_IN = ("fashion_mnist", "synthetic")  # the names of the sets tfmulti brings


def _safe(text: str) -> str:
    return re.sub(r"[^\w.-]", "_", text)


def _last_folder(spec: str) -> str:
    path = spec[len("folder:"):].rstrip("/\\")
    return _safe(path.replace("\\", "/").rsplit("/", 1)[-1]) or "folder"


def _files_stem(spec: str) -> str:
    """The training files' pattern's stem, or their folder's name: tfrecord:data/train-*,... ->
    train."""
    train = spec[len("tfrecord:"):].split(",")[0].strip().rstrip("/\\")
    stem = re.sub(r"[*?\[\]].*", "", train.replace("\\", "/").rsplit("/", 1)[-1])
    folder = train.replace("\\", "/").rsplit("/", 2)
    return _safe(stem.strip("-_.") or (folder[-2] if len(folder) > 1 else "") or "tfrecord")


def _two_patterns(spec: str) -> None:
    if len([p for p in spec[len("tfrecord:"):].split(",") if p.strip()]) != 2:
        raise UsageError(f"--dataset={spec}: give tfrecord:TRAIN_FILES,EVAL_FILES, two file "
                         "patterns (data/train-*.tfrecord,data/test-*.tfrecord)")


def _prefixed(prefix: str) -> Callable[[str], bool]:
    return lambda spec: spec.startswith(prefix)


def _something_after(what: str) -> Callable[[str], None]:
    def check(spec: str) -> None:
        prefix, _, rest = spec.partition(":")
        if not rest:
            raise UsageError(f"--dataset={spec}: give {what} after '{prefix}:'")
    return check


@dataclasses.dataclass(frozen=True)
class Source:
    """One kind of --dataset value and what the run makes of it."""
    name: str  # builtin, folder, tfds, tfrecord, function
    form: str  # how it is written, for messages: folder:DIR
    module: str  # the module whose load(spec, request) -> DataSet reads its examples
    matches: Callable[[str], bool]  # spec -> whether it is this source's
    label: Callable[[str], str]  # spec -> a short name for folders: flowers, mymod.load
    check: Callable[[str], None] = lambda spec: None  # UsageError for a malformed spec
    # your model takes the features as the source returns them, as model.fit gives them (no
    # scaling, no channel axis, no resizing); tfmulti's models always take scaled images
    features_as_given: bool = False
    named_splits: bool = False  # --train_split, --eval_split, --validation_set name its splits
    parsed: bool = False  # --parse=MODULE:FUNCTION reads its records (required)
    your_code: bool = False  # the spec is your MODULE:FUNCTION: run.json records its file


SOURCES = (  # in the order they are matched: a prefix before MODULE:FUNCTION
    Source("builtin", "fashion_mnist or synthetic", "tfmulti.data.builtin",
           BUILT_IN.__contains__, label=str),
    Source("folder", "folder:DIR", "tfmulti.data.folder", _prefixed("folder:"), _last_folder,
           check=_something_after("a directory")),
    Source("tfds", "tfds:NAME", "tfmulti.data.tfds_sets", _prefixed("tfds:"),
           lambda s: _safe(s[len("tfds:"):]), check=_something_after("a tensorflow-datasets name"),
           named_splits=True),
    Source("tfrecord", "tfrecord:TRAIN_FILES,EVAL_FILES", "tfmulti.data.tfrecord",
           _prefixed("tfrecord:"), _files_stem, check=_two_patterns, features_as_given=True,
           parsed=True),
    Source("function", "MODULE:FUNCTION", "tfmulti.data.function", lambda s: bool(SPEC.match(s)),
           lambda s: s.replace(":", "."), features_as_given=True, your_code=True),
)


def source_of(spec: str) -> Source:
    """The Source of --dataset=spec, checked; UsageError naming every form for anything else."""
    for source in SOURCES:
        if source.matches(spec):
            source.check(spec)
            return source
    raise UsageError(f"--dataset={spec}: choose one of {', '.join(BUILT_IN)}, or your own: "
                     f"{', '.join(s.form for s in SOURCES[1:-1])} or {SOURCES[-1].form}")


def label(spec: str) -> str:
    """A short name of the data set for folder names: fashion_mnist, mymod.load, flowers."""
    return source_of(spec).label(spec)
