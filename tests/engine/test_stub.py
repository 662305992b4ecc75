"""The type stubs (rust/python/gemma_engine/__init__.pyi, and testing.pyi for `gemma_engine.testing`) against
the compiled module they describe.

The stubs are written by hand beside rust/src/bindings.rs; this test is what keeps them in step, as
huggingface/tokenizers checks its generated stubs (`bindings/python/stub.py --check` in CI). Each stub is
parsed with `ast`; the module is read through `inspect.signature`, which works on PyO3's callables because
PyO3 sets `__text_signature__` from each `#[pyo3(signature = ...)]`. Compared: the public names (each stub's
with its module's `__all__`, and both together with every public name of gemma_engine._native, each declared
once), each class's public methods and properties (a `#[getter]` or `get_all` field is a property; a stub may
write it as an annotated attribute), and each callable's parameter names, kinds and defaults. PyO3 writes a
default it cannot print as a literal (`Vec::new()`) as `...`: there the stub needs only to have a default.
"""

import ast
import inspect
from pathlib import Path

import pytest

import gemma_engine
from gemma_engine import _native, testing

# Each stub and the module whose `__all__` it declares.
STUBS = {Path(gemma_engine.__file__).with_name("__init__.pyi"): gemma_engine,
         Path(gemma_engine.__file__).with_name("testing.pyi"): testing}
# A stub default that is not a literal (a name, a call).
NOT_LITERAL = object()


def _stub_signature(fn: ast.FunctionDef, drop_self: bool) -> list[tuple[str, inspect._ParameterKind, object]]:
    """(name, kind, default) of each parameter of a stub function; inspect.Parameter.empty for none."""
    a = fn.args
    positional = [(p, inspect.Parameter.POSITIONAL_ONLY) for p in a.posonlyargs]
    positional += [(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in a.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [(p.arg, kind, d) for (p, kind), d in zip(positional, defaults)]
    if a.vararg:
        params.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append((p.arg, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty if d is None else d))
    if a.kwarg:
        params.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))

    def value(d):
        if d is inspect.Parameter.empty:
            return d
        try:
            return ast.literal_eval(d)
        except ValueError:
            return NOT_LITERAL

    out = [(name, kind, value(d)) for name, kind, d in params]
    return out[1:] if drop_self else out


def _runtime_signature(obj, drop_self: bool) -> list[tuple[str, inspect._ParameterKind, object]]:
    params = list(inspect.signature(obj).parameters.values())
    out = [(p.name, p.kind, p.default) for p in params]
    return out[1:] if drop_self else out


def _signature_mismatch(where: str, stub, runtime) -> list[str]:
    """What differs between a stub signature and the module's, one line each (empty: they agree).
    `self` is compared by position only: PyO3 makes it positional-only, a stub rarely writes the `/`."""
    if [(n, k) for n, k, _ in stub] != [(n, k) for n, k, _ in runtime]:
        return [f"{where}: stub parameters {[(n, k.name) for n, k, _ in stub]}, "
                f"module {[(n, k.name) for n, k, _ in runtime]}"]
    problems = []
    for (name, _, s), (_, _, r) in zip(stub, runtime):
        if (s is inspect.Parameter.empty) != (r is inspect.Parameter.empty):
            problems.append(f"{where}({name}): stub default {s!r}, module default {r!r}")
        elif r is Ellipsis or s is NOT_LITERAL:
            continue  # a default PyO3 cannot print, or a stub default that is not a literal
        elif s is not inspect.Parameter.empty and (type(s), s) != (type(r), r):
            problems.append(f"{where}({name}): stub default {s!r}, module default {r!r}")
    return problems


def _is_property(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def stub_mismatches(trees: dict[Path, ast.Module]) -> list[str]:
    """Every difference between the parsed stubs `trees` (by path, as STUBS) and the compiled module, one line
    each."""
    problems, declared = [], []
    for path, tree in trees.items():
        names, found = _module_mismatches(tree, STUBS[path])
        declared += names
        problems += found
    native = {n for n in vars(_native) if not n.startswith("_")} | {"__version__"}
    if set(declared) != native:
        problems.append(f"public names: only in the stubs {sorted(set(declared) - native)}, "
                        f"only in gemma_engine._native {sorted(native - set(declared))}")
    twice = sorted({n for n in declared if declared.count(n) > 1})
    if twice:
        problems.append(f"public names: declared in more than one stub {twice}")
    return problems


def _module_mismatches(tree: ast.Module, module) -> tuple[list[str], list[str]]:
    """(the names the stub `tree` declares, every difference between it and `module`, one line each)."""
    problems = []
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")}
    # Annotated module attributes (`BUILD: dict[...]`); a plain assignment is a type alias (`Finish`).
    attributes = {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    stub_names = set(functions) | set(classes) | attributes
    if stub_names != set(module.__all__):
        problems.append(f"public names: only in the stub {sorted(stub_names - set(module.__all__))}, "
                        f"only in {module.__name__}.__all__ {sorted(set(module.__all__) - stub_names)}")
    for name, fn in functions.items():
        obj = getattr(module, name, None)
        if callable(obj):
            problems += _signature_mismatch(name, _stub_signature(fn, False), _runtime_signature(obj, False))
        else:
            problems.append(f"{name}: a function in the stub, {obj!r} in the module")
    for name, cls in classes.items():
        runtime = getattr(module, name, None)
        if not isinstance(runtime, type):
            problems.append(f"{name}: a class in the stub, {runtime!r} in the module")
            continue
        defs = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
        stub_methods = {n for n, f in defs.items() if not n.startswith("_") and not _is_property(f)}
        stub_properties = {n for n, f in defs.items() if not n.startswith("_") and _is_property(f)}
        stub_properties |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)
                            and isinstance(n.target, ast.Name) and not n.target.id.startswith("_")}
        members = {n: v for n, v in vars(runtime).items() if not n.startswith("_")}
        methods = {n for n, v in members.items() if callable(v)}
        properties = {n for n, v in members.items() if inspect.isdatadescriptor(v)}
        for kind, stub_set, module_set in [("methods", stub_methods, methods),
                                           ("properties", stub_properties, properties)]:
            if stub_set != module_set:
                problems.append(f"{name} {kind}: only in the stub {sorted(stub_set - module_set)}, "
                                f"only in the module {sorted(module_set - stub_set)}")
        for m in sorted(stub_methods & methods):
            problems += _signature_mismatch(f"{name}.{m}", _stub_signature(defs[m], True),
                                            _runtime_signature(getattr(runtime, m), True))
        constructible = runtime.__text_signature__ is not None
        if "__init__" in defs and constructible:
            problems += _signature_mismatch(f"{name}.__init__", _stub_signature(defs["__init__"], True),
                                            _runtime_signature(runtime, False))
        elif ("__init__" in defs) != constructible:
            problems.append(f"{name}: __init__ {'in' if '__init__' in defs else 'not in'} the stub, the module's "
                            f"class {'takes' if constructible else 'has no'} constructor arguments")
    return sorted(stub_names), problems


def _parsed() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in STUBS}


def test_the_stub_names_every_class_function_method_and_parameter_the_module_has():
    problems = stub_mismatches(_parsed())
    assert not problems, "\n".join(problems)


def _edited(old: str, new: str) -> dict[Path, ast.Module]:
    """The parsed stubs, `old` replaced by `new` in the one stub that holds it."""
    texts = {path: path.read_text() for path in STUBS}
    holding = [path for path, text in texts.items() if old in text]
    assert len(holding) == 1, old
    texts[holding[0]] = texts[holding[0]].replace(old, new, 1)
    return {path: ast.parse(text) for path, text in texts.items()}


@pytest.mark.parametrize(
    "old, new, expect",
    [
        # A method renamed, one removed, one added.
        ("def logits(self, ids", "def logits_of(self, ids", "Engine methods"),
        ("    def layout(self)", "    def _layout(self)", "Engine methods"),
        ("    def layout(self)", "    def stats(self) -> dict: ...\n    def layout(self)", "Engine methods"),
        # A property the module does not have, and a function.
        ("    @property\n    def eos_ids(self)", "    @property\n    def eos(self)", "Engine properties"),
        ("def uniform(seeds", "def uniform_numbers(seeds", "public names"),
        # A native function in neither stub, and one in both.
        ("def uniform(seeds", "def _uniform(seeds", "only in gemma_engine._native ['uniform']"),
        ("def smoke(like", "def uniform(seeds: Sequence[int], steps: Sequence[int]) -> list[float]: ...\n\n"
                           "def smoke(like", "declared in more than one stub ['uniform']"),
        # A parameter renamed, its default changed, a parameter made keyword-only.
        ("max_new: int,\n        stop_ids", "max_tokens: int,\n        stop_ids", "Request.__init__"),
        ("read_every: int = 1,\n    ) -> None", "read_every: int = 2,\n    ) -> None", "Engine.run(read_every)"),
        ("def matmul_sum(a: torch.Tensor, b", "def matmul_sum(a: torch.Tensor, *, b", "matmul_sum"),
        ("        top_k: int = 0,", "        top_k: int = 1,", "SamplingParams.__init__(top_k)"),
    ],
)
def test_the_stub_check_fails_on_a_renamed_removed_or_added_name_or_a_changed_parameter(old, new, expect):
    problems = stub_mismatches(_edited(old, new))
    assert any(expect in p for p in problems), problems
