"""Preflight: the main job's flags checked against this machine before a long run starts;
the checks are tfmulti/doctor/ (checkup.examine)."""
from tfmulti.doctor import checkup
from tfmulti.doctor.report import finish
from tfmulti.run import config, flagdefs


def main():
    FLAGS = flagdefs.FLAGS
    options = checkup.DoctorOptions(
        allreduce_mb=FLAGS.doctor_allreduce_mb, timeout=FLAGS.doctor_timeout,
        predict=FLAGS.doctor_predict, measure_budget=FLAGS.measure_budget,
        model_dir=FLAGS.model_dir, dataset=FLAGS.dataset, data_dir=FLAGS.data_dir)
    finish(checkup.examine(lambda: config.from_flags(FLAGS), options))
