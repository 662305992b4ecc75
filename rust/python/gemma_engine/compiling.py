"""The compiled decode step: the Rust model's ATen calls recorded at the dispatcher and compiled.

`Engine(..., compiler=StepCompiler("inductor"))` makes the engine hand each decode-step shape to
the compiler once (rust/src/engine/compiled.rs says when). The compiler

1. runs the eager step under `torch.fx.experimental.proxy_tensor.make_fx` (a TorchDispatchMode, so
   it records the ATen calls the engine's C++ shim makes, with the GIL released or not, exactly as
   it records Python's), which gives an FX graph of ATen ops;
2. makes every tensor the step touched but did not create (weights, the KV rings, the slots' tokens
   and positions, the sampler's state, the grammar masks; make_fx records them as constants) an
   input of the graph (`lift_constants`): one input per storage, the whole storage, and each
   tensor re-made from it by narrow / view / select / permute / unsqueeze / expand, the views
   functionalization can follow, so in-place writes to the cache are writes to an input (and
   Inductor makes them in place: no step copies the cache); a constant without elements is made
   anew in the graph;
3. hands the graph and those inputs to a dynamo backend by name (`torch._dynamo.lookup_backend`:
   "inductor" on CUDA and the CPU, "tpu" once torch_tpu is imported), the contract every backend
   keeps (`backend(gm, example_inputs) -> callable`), and returns a zero-argument callable that runs
   the compiled step on the same tensors.

With `donate=True` (the server's choice on a TPU) step 3 differs: the graph is made functional
(`functional_step`: it writes no input, and returns the new value of each input it wrote), and a
compiler that takes `donated_inputs` compiles it, told it may write those values over the inputs they
replace (XLA's buffer donation). Each replay then gives the engine the new values without a copy
(`gemma_engine.adopt_storage_`). torch_tpu's dynamo backend offers no donation: it runs AOTAutograd with
`keep_inference_input_mutations=False` (torch_tpu 0.2.0 `_internal/compile/_backend.py`), so its program
returns every ring a step writes as a new buffer and AOTAutograd copies each back into the engine's after
the program: every KV ring copied each step (read in the source, not measured on a TPU). Its `StaticCompiler`
takes `donated_inputs` for a graph traced by make_fx (`_internal/compile/compiler.py`,
`StaticCompiler.__call__`), which is what this path hands it.

Nothing a request writes is baked in: the step's host values are its shape key (bucket, padding,
sampling stages), and every tensor it reads is an input read at each call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx.experimental.proxy_tensor import make_fx

log = logging.getLogger(__name__)

BACKENDS = ("inductor", "tpu")

_aten = torch.ops.aten
_VIEW_OPS = {
    "narrow": _aten.narrow.default,
    "view": _aten.view.default,
    "select": _aten.select.int,
    "permute": _aten.permute.default,
    "unsqueeze": _aten.unsqueeze.default,
    "squeeze": _aten.squeeze.dim,
    "expand": _aten.expand.default,
}


def view_chain(size: list[int], stride: list[int], offset: int, numel: int) -> list[tuple[str, tuple]]:
    """The view ops that make the tensor (size, stride, storage offset) from a flat `[numel]` base.

    Works for every view made by narrowing, selecting, permuting, reshaping a contiguous region,
    unsqueezing and expanding: strides that nest (each divides the next larger one). Raises
    ValueError for any other layout (the capture then falls back to eager with that reason).
    """
    if any(s == 0 for s in size):
        raise ValueError(f"an empty tensor {size} cannot be re-made from its storage")
    real = [d for d in range(len(size)) if size[d] != 1 and stride[d] != 0]
    order = sorted(real, key=lambda d: -stride[d])
    st = [stride[d] for d in order]
    sz = [size[d] for d in order]
    if order:
        for a, b in zip(st, st[1:], strict=False):
            if a % b or a == b:
                raise ValueError(f"strides {stride} do not nest")
        inner = st[-1]
        parent = [sz[0]] + [a // b for a, b in zip(st, st[1:], strict=False)] + ([inner] if inner > 1 else [])
        rest = offset % st[0]
        start0 = offset - rest
        starts = [0]
        for s in st[1:] + ([1] if inner > 1 else []):
            starts.append(rest // s)
            rest %= s
        span = sz[0] * st[0]
        if start0 + span > numel:
            raise ValueError(f"a view {size} at offset {offset} runs past its storage of {numel} elements")
        ops: list[tuple[str, tuple]] = [("narrow", (0, start0, span)), ("view", (parent,))]
        for j in range(1, len(parent)):
            size_j = sz[j] if j < len(sz) else 1
            if starts[j] + size_j > parent[j]:
                raise ValueError(f"a view {size} with strides {stride} does not nest in its storage")
            if (starts[j], size_j) != (0, parent[j]):
                ops.append(("narrow", (j, starts[j], size_j)))
        if inner > 1:
            ops.append(("select", (len(parent) - 1, 0)))
        perm = sorted(range(len(order)), key=lambda i: order[i])
        if perm != list(range(len(order))):
            ops.append(("permute", (perm,)))
    else:
        ops = [("narrow", (0, offset, 1)), ("squeeze", (0,))]
    ops += [("unsqueeze", (d,)) for d in range(len(size)) if d not in real]
    if any(stride[d] == 0 and size[d] != 1 for d in range(len(size))):
        ops.append(("expand", (list(size),)))
    return ops


def natural_shape(size: list[int], stride: list[int], numel: int) -> list[int] | None:
    """The contiguous shape of a whole storage of `numel` elements of which (size, stride) is a view made by
    narrowing (a KV ring's rows and heads: the ring tensor's own shape), or None when there is none."""
    real = sorted((d for d in range(len(size)) if size[d] != 1 and stride[d] != 0), key=lambda d: -stride[d])
    st = [stride[d] for d in real]
    if not st or st[-1] != 1 or numel % st[0] or any(a % b or a == b for a, b in zip(st, st[1:], strict=False)):
        return None
    return [numel // st[0]] + [a // b for a, b in zip(st, st[1:], strict=False)]


def chain_from(base: list[int], size: list[int], stride: list[int], offset: int) -> list[tuple[str, tuple]] | None:
    """The view ops that make (size, stride, offset) from a contiguous tensor of shape `base` by narrowing its
    dimensions, or None when the view is not such a narrowing (then it is made from the flat storage)."""
    base_stride = [1] * len(base)
    for j in range(len(base) - 2, -1, -1):
        base_stride[j] = base_stride[j + 1] * base[j + 1]
    real = [d for d in range(len(size)) if size[d] != 1 and stride[d] != 0]
    dim_of = {}
    for d in real:
        if stride[d] not in base_stride or base_stride.index(stride[d]) in dim_of.values():
            return None
        dim_of[d] = base_stride.index(stride[d])
    starts, rest = [], offset
    for s in base_stride:
        starts.append(rest // s)
        rest -= starts[-1] * s
    ops: list[tuple[str, tuple]] = []
    mapped = {j: d for d, j in dim_of.items()}
    for j, n in enumerate(base):
        length = size[mapped[j]] if j in mapped else 1
        if starts[j] + length > n:
            return None
        if (starts[j], length) != (0, n):
            ops.append(("narrow", (j, starts[j], length)))
    ops += [("squeeze", (j,)) for j in reversed(range(len(base))) if j not in mapped]
    order = sorted(real, key=lambda d: dim_of[d])  # the kept dims, in the base's order
    perm = sorted(range(len(order)), key=lambda i: order[i])
    if perm != list(range(len(order))):
        ops.append(("permute", (perm,)))
    ops += [("unsqueeze", (d,)) for d in range(len(size)) if d not in real]
    if any(stride[d] == 0 and size[d] != 1 for d in range(len(size))):
        ops.append(("expand", (list(size),)))
    return ops


def lift_constants(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Turn the graph's tensor constants into inputs, in place; returns the inputs, in order.

    One input per (storage, dtype), the whole storage: in the contiguous shape its largest constant narrows
    (`natural_shape`: a KV ring's own shape), else flat. Each constant becomes the chain of views of its input
    that it is of its storage: narrowings of that shape (`chain_from`), else `view_chain` of the flat storage.
    The shape matters to the compiler: Inductor writes an `index_put_` through narrowings of an input in place,
    but copies the whole storage for one through a reshaped flat storage.
    """
    graph = gm.graph
    _keep_packed_weights(gm)
    attrs = [n for n in graph.nodes if n.op == "get_attr" and not getattr(gm, n.target).is_mkldnn]
    first = next(iter(graph.nodes))
    empties = [n for n in attrs if getattr(gm, n.target).numel() == 0]
    for node in empties:
        _remake_empty(gm, node)
    attrs = [n for n in attrs if n not in empties]

    def key(t: torch.Tensor) -> tuple:
        return (t.untyped_storage().data_ptr(), t.dtype, t.device)

    groups: dict[tuple, list[torch.Tensor]] = {}
    for node in attrs:
        t = getattr(gm, node.target)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"constant {node.target} is a {type(t).__name__}, not a tensor")
        groups.setdefault(key(t), []).append(t)
    inputs: list[torch.Tensor] = []
    bases: dict[tuple, tuple[torch.fx.Node, list[int]]] = {}
    for k, tensors in groups.items():
        t = max(tensors, key=torch.Tensor.numel)
        shape = natural_shape(list(t.size()), list(t.stride()), _numel(t)) or [_numel(t)]
        with graph.inserting_before(first):
            bases[k] = (graph.placeholder(f"input{len(inputs)}"), shape)
        inputs.append(t.as_strided(shape, torch.empty(shape, device="meta").stride(), 0))
    for node in attrs:
        t = getattr(gm, node.target)
        x, shape = bases[key(t)]
        size, stride, offset = list(t.size()), list(t.stride()), t.storage_offset()
        chain = chain_from(shape, size, stride, offset)
        if chain is None:
            chain = ([("view", ([-1],))] if len(shape) > 1 else []) + view_chain(size, stride, offset, _numel(t))
        with graph.inserting_before(node):
            for name, args in chain:
                x = graph.call_function(_VIEW_OPS[name], (x, *args))
        node.replace_all_uses_with(x)
        graph.erase_node(node)
    for target in {n.target for n in attrs + empties}:
        delattr(gm, target)
    graph.lint()
    gm.recompile()
    return inputs


def _keep_packed_weights(gm: torch.fx.GraphModule) -> None:
    """Make oneDNN's packed weights (opaque: no storage to view) buffers of the graph module, the only ones it has.

    They never change, and Inductor lowers `mkldnn._linear_pointwise` only over a weight that is a constant of
    its graph (torch 2.14 `torch/_inductor/mkldnn_lowerings.py`, "weight must be a graph constant"); a plain
    attribute becomes an input of AOTAutograd's graph, a buffer a constant once Inductor freezes the module's
    parameters and buffers (`torch/_inductor/freezing.py` `replace_params_with_constants`), which
    `StepCompiler.compile` asks for where there are any. Nothing else is a buffer, so nothing else is frozen:
    the state a step reads stays inputs. Freezing keeps the tensor itself (no copy, no repacking).
    """
    for node in gm.graph.nodes:
        if node.op == "get_attr" and getattr(gm, node.target).is_mkldnn:
            packed = getattr(gm, node.target)
            delattr(gm, node.target)
            gm.register_buffer(node.target, packed)


def _remake_empty(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Replace the constant of `node`, which holds no element (a verify step's drafts when it has none), by a new
    empty tensor of its shape: there is nothing of it to read."""
    t = getattr(gm, node.target)
    with gm.graph.inserting_before(node):
        empty = gm.graph.call_function(_aten.empty.memory_format, (list(t.size()),),
                                       {"dtype": t.dtype, "device": t.device})
    node.replace_all_uses_with(empty)
    gm.graph.erase_node(node)


def _numel(t: torch.Tensor) -> int:
    """Elements of `t`'s dtype its storage holds."""
    return t.untyped_storage().nbytes() // t.element_size()


def functional_step(gm: torch.fx.GraphModule, inputs: list[torch.Tensor],
                    decompositions: dict | None = None) -> tuple[torch.fx.GraphModule, list[int]]:
    """The step as a graph that writes none of its inputs, and the indices of the inputs the step writes.

    `gm` is traced again through `torch.func.functionalize` (fake tensors: nothing runs, nothing is written), which
    turns each write into the computation of its input's new value followed by a copy into the input; those copies
    are removed and their values returned after the step's own outputs, in the order of the indices returned.
    Raises ValueError when a write of another kind is left (the capture then falls back to eager with it).
    """
    from torch.func import functionalize

    fgm = make_fx(functionalize(gm, remove="mutations_and_views"), decomposition_table=decompositions or {},
                  tracing_mode="fake")(*inputs)
    graph = fgm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    writes = [n for n in graph.nodes
              if n.op == "call_function" and n.target is _aten.copy_.default and n.args[0] in placeholders]
    written = [placeholders.index(n.args[0]) for n in writes]
    if len(set(written)) != len(written):
        raise ValueError("an input is written twice at the end of its functional graph")
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = (tuple(output.args[0]) + tuple(n.args[1] for n in writes),)
    for node in writes:
        graph.erase_node(node)
    left = [str(n.target) for n in graph.nodes if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable]
    if left:
        raise ValueError(f"the functional graph still writes with {left}")
    graph.lint()
    fgm.recompile()
    return fgm, written


def storage_swap_check(device: torch.device | str) -> str | None:
    """Whether `gemma_engine.adopt_storage_` gives a donating compiler's new values to the engine on `device`: after
    a tensor's storage takes another's memory, a view of it made before must read the other's values, and a write
    to it must show in the view. None when it does; else what went wrong (then a step is compiled without
    donation)."""
    import gemma_engine

    try:
        base = torch.zeros(8, device=device)
        view = base[2:]
        gemma_engine.adopt_storage_(base, torch.arange(8.0, device=device))
        base.add_(1.0)
        got = view.cpu().tolist()
    except Exception as e:  # noqa: BLE001 - whatever the device raises is the reason
        return f"swapping storages failed: {type(e).__name__}: {e}"
    want = [float(i + 1) for i in range(2, 8)]
    return None if got == want else f"a view read {got} after its storage took another's memory, not {want}"


def capture(run: Callable[[], list[torch.Tensor]]) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """Run `run` once, recorded at the dispatcher; the graph (constants lifted) and its inputs."""
    gm = make_fx(run, tracing_mode="real")()
    return gm, lift_constants(gm)


@dataclass
class StepCompiler:
    """The engine's compiler hook (`Engine(compiler=...)`): records a step and compiles it.

    `backend` is a dynamo backend, by name ("inductor"; "tpu" after `import torch_tpu`) or itself. On CUDA the
    engine captures each replay as a CUDA graph itself (rust/src/engine/compiled.rs): Inductor's own CUDA graphs
    skip a graph that mutates inputs, as every step does its KV rings.
    """

    backend: str | Callable = "inductor"
    options: dict = field(default_factory=dict)
    #: Compile the functional step with its written inputs donated (module docs): "tpu" (torch_tpu's
    #: StaticCompiler) or a callable `backend(gm, example_inputs, donated_inputs=[...]) -> callable`.
    donate: bool = False
    #: (step name, compile seconds) of each compile, in order.
    compiled: list[tuple[str, float]] = field(default_factory=list)
    #: The graphs handed to the backend, by step name (kept for tests and debugging).
    graphs: dict[str, torch.fx.GraphModule] = field(default_factory=dict)
    #: (step name, reason) of each capture or compile that failed, in order.
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    #: Called as on_fallback(step name, reason) when a capture or compile fails (the engine then runs that
    #: step eagerly): a metric's hook.
    on_fallback: Callable[[str, str], None] | None = None

    @property
    def backend_name(self) -> str:
        return self.backend if isinstance(self.backend, str) else self.backend.__name__

    def __call__(self, name: str, run: Callable[[], list[torch.Tensor]]) -> Callable[[], list[torch.Tensor]]:
        started = time.perf_counter()
        try:
            gm, inputs = capture(run)
            self.graphs[name] = gm
            compiled = self.compile(gm, inputs)
        except Exception as e:
            self.fell_back(name, f"its capture or compile failed: {type(e).__name__}: {e}")
            raise
        self.compiled.append((name, time.perf_counter() - started))
        log.info("compiled %s with %s in %.1f s (%d inputs)", name, self.backend_name, self.compiled[-1][1], len(inputs))

        def replay() -> list[torch.Tensor]:
            return list(compiled(*inputs))

        return replay

    def fell_back(self, name: str, reason: str) -> None:
        """A step that does not run as compiled (the engine calls this too, when a compiled step's CUDA graph
        fails): logged, kept, and passed to `on_fallback`."""
        log.warning("step %s does not run compiled: %s", name, reason)
        self.fallbacks.append((name, reason))
        if self.on_fallback is not None:
            self.on_fallback(name, reason)

    def describe(self) -> dict:
        """{"backend", "donate", "compiled": [(step, seconds)], "fallbacks": [(step, reason)]}: safe to read from
        any thread while the engine runs."""
        return {"backend": self.backend_name, "donate": self.donate,
                "compiled": [(n, round(t, 3)) for n, t in list(self.compiled)], "fallbacks": list(self.fallbacks)}

    def compile(self, gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable:
        """`backend(gm, inputs)` inside a tracing context whose fake mode has a ShapeEnv, as dynamo calls a
        backend (Inductor's FX graph cache and AOTAutograd's cache are bypassed without one, so every restart
        would compile again); `options` patch Inductor's config for the call (e.g. "max_autotune"). A graph over
        oneDNN's packed weights (its buffers, `_keep_packed_weights`) is compiled with Inductor's `freezing`,
        under no_grad as freezing requires; Inductor's FX-graph cache skips such a graph (torch 2.14
        `codecache.py`: "mkldnn tensors unpickleable"), so it compiles again at every start. With `donate`, the
        functional step with its written inputs donated instead (`compile_donating`)."""
        if self.donate:
            return self.compile_donating(gm, inputs)
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        backend = torch._dynamo.lookup_backend(self.backend)
        options = dict(self.options)
        if self.backend == "inductor" and next(gm.buffers(), None) is not None:
            options["freezing"] = True
        with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))), torch.no_grad():
            if options and self.backend == "inductor":
                import torch._inductor.config as inductor_config

                with inductor_config.patch(options):
                    return backend(gm, inputs)
            if self.options:
                return backend(gm, inputs, options=self.options)
            return backend(gm, inputs)

    def compile_donating(self, gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable:
        """The step made functional (`functional_step`) and compiled with the inputs it writes donated; each call
        runs it and swaps each written input's memory for its new value's (`gemma_engine.adopt_storage_`), so the
        engine's own tensors read the new values and no ring is copied."""
        import gemma_engine

        if self.backend == "tpu":
            # torch_tpu 0.2.0 `_internal/compile/_backend.py` `_TPU_DECOMPOSITIONS`, which its dynamo backend applies.
            from torch._decomp import get_decompositions
            from torch_tpu._internal.compile.compiler import StaticCompiler

            decompositions = get_decompositions([_aten.masked_fill.Tensor, _aten.masked_fill_.Tensor])
            compiler: Callable = StaticCompiler()
        elif callable(self.backend):
            decompositions, compiler = None, self.backend
        else:
            raise ValueError(f"backend {self.backend!r} takes no donated inputs: donate needs 'tpu' or a callable")
        fgm, written = functional_step(gm, inputs, decompositions)
        compiled = compiler(fgm, inputs, donated_inputs=written)
        own = len(fgm.graph.find_nodes(op="output")[0].args[0]) - len(written)

        def run(*args: torch.Tensor) -> list[torch.Tensor]:
            out = list(compiled(*args))
            for i, value in zip(written, out[own:], strict=True):
                gemma_engine.adopt_storage_(args[i], value)
            return out[:own]

        return run
