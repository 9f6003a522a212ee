"""Passes on small hand-built graphs."""

import torch
import torch.fx as fx

from poros_fx.ops import LOAD
from poros_fx.passes.block_partition import BLOCK, FORWARD, _unshare_loads
from poros_fx.passes.residency import aliases


def test_a_load_read_by_two_blocks_is_split():
    g = fx.Graph()
    host = g.placeholder("primals_1")
    ld = g.call_function(LOAD, (host, torch.device("cpu")))
    emb = g.call_function(torch.ops.aten.relu.default, (ld,))
    mid = g.call_function(torch.ops.aten.neg.default, (emb,))
    head = g.call_function(torch.ops.aten.t.default, (ld,))
    g.output((mid, head))
    for node, block in ((ld, 0), (emb, 0), (mid, 1), (head, 3)):
        node.meta.update({BLOCK: block, FORWARD: True})
    _unshare_loads(g)
    loads = [n for n in g.nodes if n.target is LOAD]
    assert len(loads) == 2
    assert emb.args[0] is ld and head.args[0] is not ld
    second = head.args[0]
    assert second.meta[BLOCK] == 3 and second.meta[FORWARD] and second.next is head
    g.lint()


def test_aliases_follow_views_only():
    g = fx.Graph()
    ld = g.call_function(LOAD, (g.placeholder("h"), torch.device("cpu")))
    t = g.call_function(torch.ops.aten.t.default, (ld,))
    v = g.call_function(torch.ops.aten.view.default, (t, [-1]))
    copy = g.call_function(torch.ops.aten.clone.default, (v,))
    g.output((copy,))
    assert aliases(ld) == [ld, t, v]
