"""A finished run evaluated (`python -m tfmulti.evaluate`): its loss and every metric, per
class and the confusion matrix for a classifier."""
