"""XLA for each replica's forward and backward pass (--jit_compile).

Keras 3 turns XLA off under tf.distribute (its `_resolve_auto_jit_compile`); tfmulti compiles
the part of a step that is each replica's own: the model's forward pass, the loss and the
gradients (engine.Engine._forward_backward). The all-reduce and the optimizer's update stay
outside XLA, in the strategy's replica function, under every strategy. Before the first step,
the step is lowered to XLA on every replica (no step runs): a model with an op XLA cannot
compile trains without XLA and says so in one line, naming the op.
"""
import logging
import re

_UNSUPPORTED = re.compile(r"on XLA_\w+: (.+?) \(No registered")
_NODE = re.compile(r"\{\{node ([^}]+)\}\}")


def reason(error: BaseException) -> str:
    """Why XLA could not compile the step, in one line: the ops it has no kernel for (and the
    first one's node), or the error's first line."""
    from tfmulti.errors import first_line

    text = str(error)
    if "merge_call" in text:  # an all-reduce inside the model (synchronized batch norm)
        return ("the model all-reduces inside its forward pass (synchronized batch norm), "
                "which TensorFlow compiles with XLA only when every replica is a GPU")
    ops = _UNSUPPORTED.search(text)
    if ops:
        node = _NODE.search(text)
        return (f"XLA has no kernel for {ops.group(1)}"
                + (f" (the op {node.group(1)})" if node else ""))
    return first_line(error) or type(error).__name__


def lowering_refusal(strategy, forward_backward, features, targets) -> str:
    """'' when XLA lowers `forward_backward` (a tf.function with jit_compile=True) for this
    per-replica batch on every replica; else why not (reason). Runs no step: the function is
    only traced and converted to XLA's HLO, in each replica's context (its variables are the
    replica's)."""
    def lower(f, t):
        forward_backward.experimental_get_compiler_ir(f, t)(stage="hlo")

    quiet = logging.getLogger("tensorflow")  # "Using MirroredStrategy eagerly ..."
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        strategy.run(lower, args=(features, targets))
    except Exception as e:  # noqa: BLE001 -- any failure to compile is the answer
        return reason(e)
    finally:
        quiet.setLevel(level)
    return ""
