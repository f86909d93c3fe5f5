"""The tools behind `python -m tfmulti.<tool>`: each reads its flags into plain values and
calls the library. tfmulti/<tool>.py starts one through cli.main, which holds TensorFlow's
start-up lines back before the tool's imports load it."""
