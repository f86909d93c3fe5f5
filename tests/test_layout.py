"""The house's rules, checked on the source: no import cycle between tfmulti's packages, no
package over about 15% of the code, and type annotations on every function that one package
calls in another (its arguments and its return)."""
import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tfmulti"
LARGEST_SHARE = 0.16  # "about 15%": the largest package's share of tfmulti's lines


def modules():
    """{dotted module name: its parsed source} of every module of tfmulti."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = (path, ast.parse(path.read_text()))
    return found


def package(module):
    """tfmulti.data.sources -> tfmulti.data; the top-level modules are the package tfmulti."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def defined(tree):
    """{name: function node} of a module's functions and its classes' public methods."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                    found[f"{node.name}.{item.name}"] = item
    return found


def imported_names(tree, known):
    """{local name: module} for `from tfmulti.x import module` and `import tfmulti.x as m`,
    and {local name: (module, function)} for `from tfmulti.x.module import function`."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfmulti"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in known:
                    names[alias.asname or alias.name] = full
                elif node.module in known:
                    names[alias.asname or alias.name] = (node.module, alias.name)
    return names


def boundary_functions():
    """{(module, function): the modules of other packages that call it}."""
    every = modules()
    functions = {name: defined(tree) for name, (_, tree) in every.items()}
    callers = collections.defaultdict(set)
    for caller, (_, tree) in every.items():
        names = imported_names(tree, every)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and isinstance(names.get(node.value.id), str)):
                target, function = names[node.value.id], node.attr
            elif isinstance(node, ast.Name) and isinstance(names.get(node.id), tuple):
                target, function = names[node.id]
            else:
                continue
            if function in functions[target] and package(target) != package(caller):
                callers[(target, function)].add(caller)
    return callers, functions


def unannotated(node):
    """The argument names without an annotation, and 'return' when the return has none."""
    arguments = [a for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                             *filter(None, (node.args.vararg, node.args.kwarg)))
                 if a.arg not in ("self", "cls")]
    return ([a.arg for a in arguments if a.annotation is None]
            + (["return"] if node.returns is None else []))


def test_every_function_called_across_packages_is_annotated():
    callers, functions = boundary_functions()
    assert len(callers) > 50  # the check finds the calls (it would pass on none)
    missing = [f"{module}.{name}: {', '.join(unannotated(functions[module][name]))}"
               for module, name in sorted(callers) if unannotated(functions[module][name])]
    assert not missing, f"{len(missing)} without annotations:\n" + "\n".join(missing)


def test_no_import_cycle_between_packages_and_no_package_over_its_share():
    every = modules()
    edges = collections.defaultdict(set)
    lines = collections.Counter()
    for name, (path, tree) in every.items():
        lines[package(name)] += len(path.read_text().splitlines())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfmulti."):
                for alias in node.names:  # the module imported, or the one it is taken from
                    full = f"{node.module}.{alias.name}"
                    other = package(full if full in every else f"{node.module}.x")
                    if other not in (package(name), "tfmulti"):
                        edges[package(name)].add(other)

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n)))
                   for n in edges.get(start, ()))

    cycles = sorted(p for p in list(edges) if reaches(p, p))
    assert not cycles, f"packages in an import cycle: {cycles}"
    total = sum(lines.values())
    largest = max((count / total, name) for name, count in lines.items())
    assert largest[0] <= LARGEST_SHARE, f"{largest[1]} holds {largest[0]:.0%} of the code"


def test_each_tool_has_one_name():
    """`python -m tfmulti.X`, its flags module tools/X.py and, where it has a package of its
    own, X/ (its __main__.py the entry point) share one name; no other module is a tool's
    entry point."""
    from tfmulti.main import TOOLS

    for tool in TOOLS:
        assert (ROOT / "tools" / f"{tool}.py").is_file(), tool
        entries = [p for p in (ROOT / f"{tool}.py", ROOT / tool / "__main__.py") if p.is_file()]
        runs = 'cli.main(tool)' if tool == "main" else f'cli.main("{tool}")'  # main: any tool
        assert len(entries) == 1 and runs in entries[0].read_text(), tool
    calls = {path.relative_to(ROOT).as_posix() for path in ROOT.rglob("*.py")
             if "cli.main(" in path.read_text() and path.name != "cli.py"}
    assert calls == {f"{t}.py" if (ROOT / f"{t}.py").is_file() else f"{t}/__main__.py"
                     for t in TOOLS}
    assert {"tune", "doctor", "bench", "scratch"} <= {p.parent.name
                                                      for p in ROOT.rglob("__main__.py")}


# The libraries whose import costs start-up time (seconds on 2 cores: TensorFlow and Keras
# load together, numpy with them): a tool that needs none of them starts at once
HEAVY = ("tensorflow", "keras", "numpy", "keras_tuner", "tensorflow_datasets", "matplotlib",
         "tensorboard", "grpc", "array_record", "scipy")
BROUGHT = {"keras": {"tensorflow", "numpy"}, "tensorflow": {"numpy"}}


def imported(node, known):
    """The modules an import statement names: tfmulti's modules by their dotted name."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
            for a in node.names]


def top_level_imports(tree, known):
    """The modules a module imports as it loads (not under `if TYPE_CHECKING:`)."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, (ast.Import, ast.ImportFrom)) and not isinstance(
                    node, (ast.FunctionDef, ast.ClassDef)):
                found.update(imported(inner, known))
    return found


def test_an_import_inside_a_function_keeps_a_library_out_of_start_up():
    """docs/developing.md's rule: a function imports a module itself only when importing it
    at the top would load a heavy library (HEAVY) the module does not load already, or when
    the module imported imports this one as it loads (a cycle); every other import is at the
    top."""
    every = modules()
    tops = {name: top_level_imports(tree, every) for name, (_, tree) in every.items()}

    def loads(name, seen):
        for module in tops.get(name, ()):
            for i in range(1, module.count(".") + 2):  # its packages load first
                part = module.rsplit(".", module.count(".") + 1 - i)[0]
                if part not in seen:
                    seen.add(part)
                    loads(part, seen)
        return seen

    def libraries(modules):
        found = {m.split(".")[0] for m in modules} & set(HEAVY)
        return found.union(*(BROUGHT.get(lib, set()) for lib in found))

    closure = {name: loads(name, set()) for name in every}
    needless = []
    for name, (_, tree) in every.items():
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                for module in imported(node, every):
                    brings = libraries({module} | closure.get(module, set()))
                    if brings - libraries(closure[name]) or name in closure.get(module, ()):
                        continue
                    needless.append(f"{name}:{node.lineno} {module}")
    assert len(closure["tfmulti.training.engine"]) > 20  # the check follows the imports
    assert not needless, "imports to move to the top:\n" + "\n".join(sorted(set(needless)))
