"""Tuning sessions on keras-tuner."""
