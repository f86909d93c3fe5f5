"""A process that never imports tfmulti, as the person a run's model is handed to:
plain_consumer.py MODEL_DIR IMAGES.npz prints, as JSON, the accuracy of model.keras (loaded
with plain Keras) and of saved_model/'s serving_default signature on the images and labels in
the .npz file, the first predicted class names, and whether tfmulti got imported."""
import json
import os
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf


def consume(model_dir, images, labels, scratch):
    """What this script prints for a run's model_dir and those test images, from a process of
    its own started outside the repository (for the tests)."""
    path = os.path.join(str(scratch), "test_images.npz")
    np.savez(path, images=images, labels=labels)
    result = subprocess.run([sys.executable, os.path.abspath(__file__), str(model_dir), path],
                            cwd=str(scratch), capture_output=True, text=True, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    model_dir, images_file = sys.argv[1], sys.argv[2]
    arrays = np.load(images_file)
    images, labels = arrays["images"], arrays["labels"]
    model = keras.saving.load_model(f"{model_dir}/model.keras")
    scale = 255.0 if images.dtype == np.uint8 else 1.0
    x = images.astype("float32") / scale
    x = x[..., None] if x.ndim == 3 else x
    keras_ids = model.predict(x, verbose=0).argmax(-1)
    serving = tf.saved_model.load(f"{model_dir}/saved_model").signatures["serving_default"]
    outputs = serving(images=tf.constant(images if images.ndim == 4 else images[..., None]))
    with open(f"{model_dir}/class_names.txt") as f:
        names = f.read().splitlines()
    print(json.dumps({
        "keras_acc": float(np.mean(keras_ids == labels)),
        "saved_acc": float(np.mean(outputs["class_ids"].numpy() == labels)),
        "classes": [c.decode() for c in outputs["classes"].numpy()[:3]],
        "names_match": [names[i] for i in outputs["class_ids"].numpy()[:3]],
        "batch_dimension": serving.structured_input_signature[1]["images"].shape.as_list()[0],
        "tfmulti_imported": any(m.startswith("tfmulti") for m in sys.modules),
    }))


if __name__ == "__main__":
    main()
