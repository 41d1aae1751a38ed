"""A recorded step (record.Graph) as a JAX function, each aten op through the device's own lowering.

The function takes the graph's inputs (parameters, optimizer state, batch) and returns the new values of the
inputs the step wrote. Mutating ops run as their functional variant (the device's opinfo helpers); views and
aliases are values (no storage is shared in a functional program); attention runs attention.py's lowering.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import attention
from .record import Graph, Node, Ref

aten = torch.ops.aten
IDENTITY = {aten.detach.default, aten.alias.default, aten.lift_fresh.default, aten.clone.default}
TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}
# ops whose output is the whole of their input under another name or shape (PyTorch: the same storage); a value
# saved for backward through two of them (an attention output saved by the attention and, detached, by activation
# checkpointing) is one buffer on a device, counted once
ALIASES = IDENTITY - {aten.clone.default} | TRANSPOSES | {aten.view.default, aten._unsafe_view.default,
                                                           aten.unsqueeze.default, aten.squeeze.dim,
                                                           aten.squeeze.default, aten.expand.default}


class Unsupported(Exception):
    pass


def _tables():
    from tpu_agent.backend.core import jax_setup  # noqa: F401  (64-bit types, as the device runs them)
    from tpu_agent.backend import ops  # noqa: F401  (fills the lowering table)
    from tpu_agent.backend.aten import opinfo
    from tpu_agent.backend.core.registry import LOWERINGS

    return LOWERINGS, opinfo


def _empty(size, *rest, dtype=None, **_):
    import jax.numpy as jnp

    from tpu_agent.backend.ops._util import default_float, jdtype

    return jnp.zeros(tuple(size), jdtype(dtype, default_float()))


def _empty_like(x, *rest, dtype=None, **_):
    import jax.numpy as jnp

    from tpu_agent.backend.ops._util import jdtype

    return jnp.zeros(x.shape, jdtype(dtype, x.dtype) if dtype is not None else x.dtype)


def _to_copy(x, *, dtype=None, **_):
    from tpu_agent.backend.ops._util import jdtype

    return x.astype(jdtype(dtype, x.dtype)) if dtype is not None else x


def _copy(self, src, non_blocking=False):
    import jax.numpy as jnp

    return jnp.broadcast_to(src.astype(self.dtype), self.shape)


EXTRA = {
    aten.empty.memory_format: _empty, aten.empty_strided.default: _empty, aten.new_empty.default:
    lambda x, size, **k: _empty(size, dtype=k.get("dtype") or _torch_dtype(x)),
    aten.empty_like.default: _empty_like, aten._to_copy.default: _to_copy, aten.copy.default: _copy,
}


def _torch_dtype(x):
    from tpu_agent.backend.core import dtypes

    return dtypes.to_torch(x.dtype) if hasattr(dtypes, "to_torch") else None


def lowerable(func) -> bool:
    """Whether the graph's function can run `func` (else the recorder decomposes it)."""
    lowerings, opinfo = _tables()
    if func in lowerings or func in EXTRA or func in IDENTITY or getattr(func, "namespace", "") == "tpu_project":
        return True
    schema = getattr(func, "_schema", None)
    if schema is not None and schema.is_mutable:
        functional = opinfo.functional_variant(func)
        return func is aten.copy_.default or (functional is not None and lowerable(functional))
    return False


class Lowered:
    """The graph as `fn(*inputs) -> outputs`; `input_ids` and `output_ids` give their value ids in order."""

    def __init__(self, graph: Graph, constrain=None):
        self.graph = graph
        self.constrain = constrain  # (shape, in backward, batch dim or None) -> a sharding for such a value, or None
        # values with a dim that runs over the batch, and which dim: the batch inputs (dim 0), then what ops make
        # from them (dim 0, or where a transpose or permute moved it)
        self.batch_dim = {v: 0 for v, (_shape, _dtype, role, _name) in graph.inputs.items() if role == "data"}
        self.shapes = {v: tuple(i[0]) for v, i in graph.inputs.items()}
        for n in graph.nodes:
            for v, shape in zip(n.outs, n.out_shapes):
                if v is not None and shape is not None:
                    self.shapes[v] = tuple(shape)
        self.input_ids = list(graph.inputs)
        self.output_ids = list(graph.outputs)
        self.lowerings, self.opinfo = _tables()
        self.key_counter = 0
        self.saved: list = []  # (shape, bytes per element, batch dim or None, a block's input) of the activations
        # backward reads from forward

    def _call(self, func, args, kwargs):
        if func in EXTRA:
            return EXTRA[func](*args, **kwargs)
        lowering = self.lowerings.get(func)
        if lowering is None:
            raise Unsupported(f"no lowering for {func}")
        if lowering.random:
            import jax

            self.key_counter += 1
            kwargs = {**kwargs, "key": jax.random.key(self.key_counter)}
        return lowering.fn(*args, **kwargs)

    def _node(self, node: Node, env: dict) -> None:
        def value(x):
            return env[x.vid] if isinstance(x, Ref) else x

        args, kwargs = tree_map(value, node.args), tree_map(value, node.kwargs)
        func = node.func
        if func is torch.ops.tpu_project.attention.default:
            import jax

            with jax.named_scope(attention.SCOPE):
                out = attention.lower_forward(*args, **kwargs)
        elif func is torch.ops.tpu_project.attention_backward.default:
            import jax

            with jax.named_scope(attention.SCOPE):
                out = attention.lower_backward(*args, **kwargs)
        elif func in IDENTITY:
            out = args[0]
        elif node.written:
            out = self._mutating(node, func, args, kwargs, env)
            if out is None:
                return
        else:
            out = self._call(func, args, kwargs)
        flat, _ = tree_flatten(out)
        if self.constrain is not None and not node.written:
            import jax

            leads = self._leads(node)
            moved = self._moved(node, args)
            for i, array in enumerate(flat):
                if not hasattr(array, "shape") or node.outs[i] is None:
                    continue
                dim = moved if i == 0 and moved is not None else (0 if self._led(tuple(array.shape), leads) else None)
                if dim is not None:
                    self.batch_dim[node.outs[i]] = dim
                sharding = self.constrain(tuple(array.shape), node.backward, dim)
                if sharding is not None:
                    flat[i] = jax.lax.with_sharding_constraint(array, sharding)
        for vid, array in zip(node.outs, flat):
            if vid is not None and vid not in env:
                env[vid] = array
        written = {new for _, _, new in node.written}
        for vid, array in zip(node.outs, flat):
            if vid is not None and vid not in written:
                env[vid] = array

    def _leads(self, node: Node) -> set:
        """Leading dims of the node's batch-led tensor inputs (and their first two dims merged)."""
        flat, _ = tree_flatten((node.args, node.kwargs))
        leads = set()
        for x in flat:
            if isinstance(x, Ref) and self.batch_dim.get(x.vid) == 0:
                shape = self.shapes.get(x.vid, ())
                if shape:
                    leads.add(shape[0])
                    if len(shape) > 1:
                        leads.add(shape[0] * shape[1])
        return leads

    def _moved(self, node: Node, args) -> int | None:
        """Where a transpose or permute of a batch-led value puts its batch dim (a weight gradient's operand
        `grad_out.t()` carries the batch in its last dim: left unconstrained, XLA:CPU's partitioner gathers it
        whole rather than reduce-scattering the gradient)."""
        if node.func not in TRANSPOSES or not node.args or not isinstance(node.args[0], Ref):
            return None
        src = self.batch_dim.get(node.args[0].vid)
        rank = len(self.shapes.get(node.args[0].vid, ()))
        if src is None or rank == 0:
            return None
        if node.func is aten.t.default:
            order = list(range(rank))[::-1]
        elif node.func is aten.permute.default:
            order = [d % rank for d in args[1]]
        else:
            a, b = args[1] % rank, args[2] % rank
            order = list(range(rank))
            order[a], order[b] = order[b], order[a]
        return order.index(src)

    @staticmethod
    def _led(shape: tuple, leads: set) -> bool:
        """A value is batch-led when its dim 0 is a batch-led input's dim 0, or those dims merged or split."""
        return bool(shape) and (shape[0] in leads or (len(shape) > 1 and shape[0] * shape[1] in leads))

    def _mutating(self, node: Node, func, args, kwargs, env):
        opinfo = self.opinfo
        names = []
        for name, _, _ in node.written:
            if name not in names:
                names.append(name)
        bound = opinfo.bind(func, args, kwargs)
        if func in self.lowerings or func in EXTRA:
            values = self._call(func, args, kwargs)
            values = [values] if len(names) == 1 else list(values)
            results = None
        elif func is aten.copy_.default:
            values, results = [_copy(bound["self"], bound["src"])], None
        else:
            functional = opinfo.functional_variant(func)
            if functional is None:
                raise Unsupported(f"no functional variant for {func}")
            fargs, fkwargs = opinfo.functional_call_args(func, functional, bound)
            result = self._call(functional, fargs, fkwargs)
            single = not isinstance(result, (list, tuple)) or opinfo.is_list_return(functional)
            results = [result] if single else list(result)
            n_returns = len(functional._schema.returns)
            if func.overloadpacket.__name__.endswith("_") or opinfo.is_out(func):
                values = results[: len(names)] if len(names) > 1 else [result]
            else:
                values = results[n_returns - len(names):]
        by_name = dict(zip(names, values))
        for name, _, new in node.written:
            value = by_name[name]
            env[new] = value
        # a list argument written element by element (foreach): its values in order
        for name in names:
            entries = [new for n, _, new in node.written if n == name]
            if len(entries) > 1:
                for new, array in zip(entries, by_name[name]):
                    env[new] = array
        if results is not None and not (func.overloadpacket.__name__.endswith("_") or opinfo.is_out(func)):
            own = results[: len(func._schema.returns)]
            return own[0] if len(own) == 1 else tuple(own)
        return [env[new] for _, _, new in node.written][: max(1, len(node.outs))]

    def _alias_roots(self) -> dict:
        """Value id -> the value it aliases whole (through detach, views, transposes), followed to the first."""
        roots: dict = {}
        for n in self.graph.nodes:
            if n.func in ALIASES and n.args and isinstance(n.args[0], Ref) and n.outs and n.outs[0] is not None:
                roots[n.outs[0]] = roots.get(n.args[0].vid, n.args[0].vid)
        return roots

    def _saved(self) -> tuple[int, set]:
        """The first backward node, and the values defined before it that backward nodes read."""
        nodes = self.graph.nodes
        first = next((i for i, n in enumerate(nodes) if n.backward), len(nodes))
        defined = set(self.input_ids) | {v for n in nodes[:first] for v in n.outs if v is not None}
        read = set()
        for n in nodes[first:]:
            flat, _ = tree_flatten((n.args, n.kwargs))
            read |= {x.vid for x in flat if isinstance(x, Ref) and x.vid in defined}
        return first, read

    def __call__(self, *arrays):
        import jax

        env = dict(zip(self.input_ids, arrays))
        first, saved = self._saved()
        for i, node in enumerate(self.graph.nodes):
            if i == first and saved:
                # What backward reads from forward passes one barrier: XLA must not merge a checkpointed
                # region's recomputation with its forward (CSE would undo activation checkpointing).
                # inputs and values shaped like a parameter (gathered weights) are never recomputed: they stay
                # out, so the barrier holds exactly the saved activations (partition.py reads its per-chip size)
                inputs = set(self.input_ids)
                params = {tuple(i[0]) for i in self.graph.inputs.values() if i[2] == "param"}
                keys = sorted(v for v in saved if v in env and v not in inputs and hasattr(env[v], "shape")
                              and tuple(env[v].shape) not in params)
                blocks = getattr(self.graph, "block_inputs", set())
                roots = self._alias_roots()
                counted: set = set()
                self.saved = []
                for k in sorted(keys, key=lambda v: -env[v].size):
                    root = roots.get(k, k)
                    if root in counted:
                        continue
                    counted.add(root)
                    self.saved.append((tuple(env[k].shape), env[k].dtype.itemsize, self.batch_dim.get(k),
                                       k in blocks or root in blocks))
                for key, value in zip(keys, jax.lax.optimization_barrier([env[k] for k in keys])):
                    env[key] = value
            try:
                self._node(node, env)
            except Unsupported:
                raise
            except Exception as exc:
                raise Unsupported(f"{node.func}: {type(exc).__name__}: {exc}") from exc
        return [env[v] for v in self.output_ids]
