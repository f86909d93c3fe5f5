"""Evaluates a finished run on its own test set or on any other data source:

    python -m tfmulti.evaluate --model_dir=runs/RUN [--dataset=folder:photos --data_dir=...]

Prints the loss and every metric of the model and writes evaluation-<data set>.json to the
run's folder; for a classifier also per-class accuracy, the confusion matrix and
confusion-<data set>.png. Without --dataset the run's
own data set is used (its run.json says which); another one must have the run's classes.
"""
from tfmulti.evaluate import evaluation
from tfmulti.run import flagdefs

DATA_FLAGS = ("dataset", "data_dir", "image_size", "synthetic_train_size",
              "synthetic_test_size", "train_split", "eval_split", "parse")


def main():
    FLAGS = flagdefs.FLAGS
    given = {name: FLAGS[name].value for name in DATA_FLAGS if FLAGS[name].present}
    found = evaluation.evaluate_run(FLAGS.model_dir, given)
    result = found.result
    after = f", the run's model after step {result['after_step']}" if result["after_step"] else ""
    print(f"evaluated {result['evaluated']}{after}")
    others = ", ".join(f"test {name} {value:.4f}" for name, value in result.items()
                       if name in found.metrics and name != "accuracy")
    accuracy = f", test acc {result['accuracy']:.4f}" if "accuracy" in result else ""
    print(f"{found.dataset_name}: test loss {result['loss']:.4f}{accuracy}"
          f"{', ' + others if others else ''} ({result['examples']} {found.examples})")
    if "per_class" not in result:
        print(f"report: {found.report_file}")
        return
    worst = sorted((acc, name) for name, acc in result["per_class"].items() if acc is not None)
    print("per class: " + ", ".join(f"{name} {acc:.2f}" for acc, name in worst))
    print(f"{'class':>14} {'precision':>9} {'recall':>7} {'f1':>5} {'support':>7}")
    for name, s in result["per_class_scores"].items():
        shown = [f"{s[k]:.2f}" if s[k] is not None else "-" for k in ("precision", "recall", "f1")]
        print(f"{name[:14]:>14} {shown[0]:>9} {shown[1]:>7} {shown[2]:>5} {s['support']:>7}")
    print(f"report: {found.report_file}, {found.picture}")
