"""A captured program as the executor and the profiler run it: its inputs and output
(an exported graph flattens them), the devices its ops name, its random ops."""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.graph import _PyTreeCodeGen
from torch.utils import _pytree as pytree

from autoplace.capture.op_rules import draws_dropout

__all__ = ["body_on_device", "devices_as", "fetch_attr", "is_exported", "model_output",
           "node_on_device", "program_inputs", "random_ops"]


def is_exported(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` came from torch.export (flattened inputs and outputs), not torch.fx."""
    return isinstance(gm.graph._codegen, _PyTreeCodeGen)


def devices_as(value: Any, device: torch.device) -> Any:
    """``value`` (a node's arguments) with every ``torch.device`` in it made ``device``: an
    exported graph keeps the device it was traced on as constants (``to(device=meta)``,
    ``aten.to.device(mask, cpu)``), where the model meant its input's device."""
    return pytree.tree_map_only(torch.device, lambda _: device, value)


def node_on_device(node: fx.Node, device: torch.device) -> None:
    """Every device ``node`` names (``device=`` or positional, as in an exported graph's
    ``aten.to.device(x, cpu)``) made ``device``, the one its op runs on, and an autocast
    region's device type (``wrap_with_autocast("cpu", ...)``) made ``device``'s: a capture
    keeps the device it traced on as a constant, where the model meant its input's."""
    if any(isinstance(a, torch.device) for a in pytree.tree_leaves((node.args, node.kwargs))):
        node.args, node.kwargs = devices_as((node.args, node.kwargs), device)
    if (node.target is getattr(torch.ops.higher_order, "wrap_with_autocast", None)
            and node.args and isinstance(node.args[0], str) and node.args[0] != device.type):
        node.args = (device.type, *node.args[1:])


def body_on_device(body: Any, device: torch.device) -> Any:
    """A copy of ``body``, a higher-order op's submodule (torch.export keeps a model's
    ``no_grad`` and autocast regions as ``wrap_with_set_grad_enabled(False, body, ...)``),
    whose ops and nested bodies name ``device`` (:func:`node_on_device`); anything else
    as it is. The copy shares the body's tensors."""
    if not isinstance(body, fx.GraphModule):
        return body
    out = fx.GraphModule(body, copy.deepcopy(body.graph))
    for n in out.graph.nodes:
        if n.op in ("call_function", "call_method"):
            node_on_device(n, device)
        elif n.op == "get_attr":
            owner_path, _, attr = n.target.rpartition(".")
            owner = out.get_submodule(owner_path) if owner_path else out
            inner = getattr(owner, attr)
            if isinstance(inner, fx.GraphModule):
                setattr(owner, attr, body_on_device(inner, device))
    out.recompile()
    return out


def program_inputs(gm: fx.GraphModule, inputs: Sequence[Any]) -> list[Any]:
    """The values of ``gm``'s placeholders for a workload's ``inputs`` tuple.

    A torch.fx trace takes the model's positional inputs as they are; an exported graph
    takes their pytree leaves (``None`` is one: an optional input left out keeps its
    placeholder, and nested tuples, lists and dicts are flattened), as its own
    ``forward`` does before it runs the nodes.
    """
    if is_exported(gm):
        return list(pytree.tree_leaves(tuple(inputs)))
    return list(inputs)


def model_output(gm: fx.GraphModule, value: Any) -> Any:
    """What the model returns, from the value of ``gm``'s output node (a program built
    from ``gm``'s nodes computes that value): an exported graph's outputs are the leaves
    of the model's output, which it puts back together (a Hugging Face ``ModelOutput``,
    a dict) in its own ``forward``; a torch.fx trace's output node is the output."""
    if is_exported(gm):
        return gm.graph._codegen.process_outputs(
            list(value) if isinstance(value, (tuple, list)) else value)
    return value


def fetch_attr(root: nn.Module, target: str) -> Any:
    """The attribute a ``get_attr`` / ``call_module`` target names (``"h.0.attn.weight"``)."""
    return operator.attrgetter(target)(root)


def random_ops(gm: fx.GraphModule) -> list[str]:
    """Names of the ops of ``gm`` that draw random numbers in training: dropout with a
    nonzero probability (a module, ``F.dropout`` or ``aten.dropout`` / ``native_dropout``
    as an exported graph records it). A plan runs them on other shares of the batch and in
    another order than the unpartitioned model, so its losses then match the reference's
    only statistically."""
    out = []
    for n in gm.graph.nodes:
        submod = gm.get_submodule(n.target) if n.op == "call_module" else None
        if n.op in ("call_module", "call_function") and draws_dropout(n, submod):
            out.append(n.name)
    return out
