"""The names of what a run leaves in its folder (lifecycle.py holds run.json's and the
checkpoints')."""
METRICS_FILE = "metrics.json"
PLOT_FILE = "accuracy.png"
MODEL_FILE = "model.keras"
SAVED_MODEL_DIR = "saved_model"  # and CLASS_NAMES_FILE: what export.py hands on beside it
CLASS_NAMES_FILE = "class_names.txt"
WEIGHTS_FILE = "model.weights.h5"  # a model without call() (nothing to serve): its weights
TENSORBOARD_DIR = "tensorboard"
RUN_FILES = (METRICS_FILE, MODEL_FILE, "checkpoints")  # their presence marks a run
