"""A user's model with random layers, killed with kill -9 and run again, ends bit for bit
where the uninterrupted run ends. The case found from outside was a CNN with batch norm, an L2
penalty and Dropout 0.25 on a numpy set, which resumed to another test loss; the CNN here is
that one with each of Keras's other random layers beside its Dropout (the augmentation layers
on its input, SpatialDropout2D on its feature maps, the noise and dropout layers before its
last layer), so one kill -9 shows every one of them resuming (test_checkpointed.py checks the
same 12 layers in-process)."""
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from test_checkpointed import random_layers
from test_resume import environment, killed_when_saved, weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS_PER_EPOCH = 24  # 1536 images at a global batch of 64

USER_CODE = '''
import keras
import numpy as np
from keras import layers


def digits():
    rng = np.random.default_rng(7)
    def draw(n):
        labels = rng.integers(0, 10, n)
        images = rng.normal(0, 0.3, (n, 16, 16, 1)).astype("float32")
        for image, label in zip(images, labels):
            image[label, :, 0] += 1.0  # a bright row per class
        return images, labels
    return draw(1536), draw(256)


def cnn(input_shape, num_classes):
    """The CNN of the case found from outside (Conv, BatchNormalization, L2, Dropout 0.25),
    with every other random layer of Keras in its training path."""
    inputs = keras.Input(input_shape)
    x = layers.RandomFlip()(inputs)
    x = layers.RandomRotation(0.1)(x)
    x = layers.RandomZoom(0.1)(x)
    x = layers.RandomTranslation(0.1, 0.1)(x)
    x = layers.RandomCrop(14, 14)(x)  # crops in training only (inference keeps 16 x 16):
    x = layers.Resizing(16, 16)(x)  # one size for Flatten either way
    x = layers.RandomContrast(0.2)(x)
    x = layers.RandomBrightness(0.1, value_range=(-1, 2))(x)
    x = layers.GaussianNoise(0.1)(x)
    x = layers.Conv2D(8, 3, padding="same", kernel_regularizer=keras.regularizers.L2(1e-4))(x)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    x = layers.Flatten()(layers.SpatialDropout2D(0.1)(x))
    x = layers.AlphaDropout(0.1)(layers.GaussianDropout(0.1)(x))
    x = layers.Dropout(0.25)(x)
    return keras.Model(inputs, layers.Dense(num_classes)(x))
'''


def command(project, model_dir):
    return [sys.executable, "-m", "tfmulti.main", "--model=yours:cnn", "--dataset=yours:digits",
            "--cpu_replicas=2", "--global_batch_size=64", "--deterministic", "--seed=3",
            f"--checkpoint_steps={STEPS_PER_EPOCH // 3}", "--epochs=2", "--steps_per_call=1",
            f"--model_dir={model_dir}"]


def env(project):
    return {**environment(), "PYTHONPATH": str(project)}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("project")
    (folder / "yours.py").write_text(USER_CODE)
    return folder


@pytest.fixture(scope="module")
def uninterrupted(project):
    model_dir = project / "uninterrupted"
    result = subprocess.run(command(project, model_dir), cwd=project, env=env(project),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return model_dir


def killed_after(project, model_dir, moment):
    """Starts the run and kill -9s it once a checkpoint at `moment` (an epoch's end, or the
    middle of an epoch) is listed; returns the step it was killed after."""
    wanted = (lambda step: step % STEPS_PER_EPOCH == 0) if moment == "epoch_end" else (
        lambda step: step % STEPS_PER_EPOCH != 0 and step > STEPS_PER_EPOCH)
    return killed_when_saved(command(project, model_dir), env(project), model_dir, wanted,
                             cwd=project)


# make soak: mid-epoch (the data position and the masks' state both matter) and at an
# epoch's end, the moment of the case found from outside (50 s in make test, over its budget;
# there test_checkpointed.py resumes the same 12 layers in-process, bit for bit)
@pytest.mark.soak
@pytest.mark.parametrize("moment", ["mid_epoch", "epoch_end"])
def test_your_model_with_every_random_layer_resumes_bit_for_bit_after_kill_9(
        project, uninterrupted, moment):
    model_dir = project / moment
    step = killed_after(project, model_dir, moment)
    resumed = subprocess.run(command(project, model_dir), cwd=project, env=env(project),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {step + 1}" in resumed.stdout
    kept = keras.saving.load_model(str(model_dir / "model.keras"))
    assert {type(layer).__name__ for layer in kept.layers} >= set(random_layers())
    for a, b in zip(weights(uninterrupted), weights(model_dir)):
        np.testing.assert_array_equal(a, b, err_msg=f"killed after step {step}")
