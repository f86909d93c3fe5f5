import math

import pytest

from tfmulti.errors import UsageError
from tfmulti.run import hparams


def test_default_is_256_per_replica():
    assert hparams.batch_sizes(2) == (256, 512)


def test_per_replica_or_global():
    assert hparams.batch_sizes(4, per_replica_batch_size=32) == (32, 128)
    assert hparams.batch_sizes(4, global_batch_size=128) == (32, 128)


@pytest.mark.parametrize("kwargs, words", [
    ({"per_replica_batch_size": 8, "global_batch_size": 16}, "both given"),
    ({"per_replica_batch_size": -8}, "--per_replica_batch_size=-8"),
    ({"global_batch_size": 0}, "--global_batch_size=0"),
    ({"global_batch_size": 15}, "does not divide over 2 replicas"),
])
def test_bad_batches(kwargs, words):
    with pytest.raises(UsageError, match=words):
        hparams.batch_sizes(2, **kwargs)


@pytest.mark.parametrize("rule, batch, expected", [
    ("linear", 512, 0.2), ("linear", 256, 0.1), ("linear", 64, 0.025),
    ("sqrt", 1024, 0.2), ("sqrt", 512, 0.1 * math.sqrt(2)), ("none", 4096, 0.1),
])
def test_learning_rate_scaling(rule, batch, expected):
    assert hparams.scaled_learning_rate(0.1, batch, rule) == pytest.approx(expected)


def test_bad_learning_rates():
    with pytest.raises(UsageError, match="positive"):
        hparams.scaled_learning_rate(0.0, 256, "linear")
    with pytest.raises(UsageError, match="--lr_scaling=cubic"):
        hparams.scaled_learning_rate(0.1, 256, "cubic")
