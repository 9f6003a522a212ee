"""Passes on small hand-built graphs."""

import torch
import torch.fx as fx

from poros_fx.compiler.ops import LOAD
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


def _schedule(stream=True):
    from poros_fx.options import PorosOptions
    from poros_fx.runtime.executor import GraphRuntime
    from poros_fx.compiler.schedule import Block, Schedule

    s = Schedule(graph_id="t", options=PorosOptions(), device=torch.device("cpu"), block_size=1, prefetch=0,
                 stream=stream, blocks=[Block(0, "embed"), Block(1, "layers.0")])
    s.runtime = GraphRuntime(None, stream, "forward")
    return s


def test_residency_refuses_a_loaded_tensor_saved_for_the_backward():
    import pytest

    from poros_fx.errors import PorosExactnessError
    from poros_fx.passes.residency import residency
    from poros_fx.passes.rng import PHASE

    g = fx.Graph()
    ld = g.call_function(LOAD, (g.placeholder("primals_1"), torch.device("cpu")))
    t = g.call_function(torch.ops.aten.t.default, (ld,))
    ld.meta[BLOCK] = t.meta[BLOCK] = 1
    g.output((t,))  # a view of the loaded weight leaves the forward
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta[PHASE] = "forward"
    with pytest.raises(PorosExactnessError, match="keep base data on the device"):
        residency(gm, _schedule())


def test_residency_refuses_anything_computed_from_loads_alone_saved_for_the_backward():
    """Not only views: a cast (or a dequantized weight) of loaded tensors is base data too; an
    activation computed from a load and an input is not."""
    import pytest

    from poros_fx.errors import PorosExactnessError
    from poros_fx.passes.residency import computed_from_loads, residency
    from poros_fx.passes.rng import PHASE

    def graph(leave_cast: bool) -> fx.GraphModule:
        g = fx.Graph()
        x = g.placeholder("x")
        ld = g.call_function(LOAD, (g.placeholder("primals_1"), torch.device("cpu")))
        scale = g.call_function(LOAD, (g.placeholder("primals_2"), torch.device("cpu")))
        cast = g.call_function(torch.ops.aten._to_copy.default, (ld,), {"dtype": torch.float32})
        weight = g.call_function(torch.ops.aten.mul.Tensor, (cast, scale))  # e.g. a dequantized weight
        mm = g.call_function(torch.ops.aten.mm.default, (x, weight))
        size = g.call_function(torch.ops.aten.sym_size.int, (weight, 0))
        size.meta["val"] = 4
        for n in g.nodes:
            n.meta[BLOCK] = 1
        g.output((mm, size, weight) if leave_cast else (mm, size))
        gm = fx.GraphModule(torch.nn.Module(), g)
        gm.meta[PHASE] = "forward"
        return gm

    gm = graph(leave_cast=False)
    loads = [n for n in gm.graph.nodes if n.target is LOAD]
    assert [n.name for n in computed_from_loads(gm.graph, loads)] == ["load_default", "load_default_1", "_to_copy_default", "mul_tensor",
                                                                      "sym_size_int"]
    residency(gm, _schedule())  # the matmul's output (an activation) and a size may leave
    with pytest.raises(PorosExactnessError, match=r"hands mul_tensor .*load_default, load_default_1 alone"):
        residency(graph(leave_cast=True), _schedule())


def test_rng_refuses_an_unwrapped_recomputed_random_op_and_graphsafe_rng():
    import pytest
    from torch._prims.rng_prims import graphsafe_run_with_rng_state

    from poros_fx.errors import PorosExactnessError
    from poros_fx.passes.rng import PHASE, rng

    def backward_graph(target, args, forward):
        g = fx.Graph()
        x = g.placeholder("x")
        node = g.call_function(target, (x, *args))
        node.meta.update({BLOCK: 1, FORWARD: forward})
        g.output((node,))
        gm = fx.GraphModule(torch.nn.Module(), g)
        gm.meta[PHASE] = "backward"
        return gm

    with pytest.raises(PorosExactnessError, match="without the forward's RNG state"):
        rng(backward_graph(torch.ops.aten.native_dropout.default, (0.1, True), forward=True), _schedule())
    # the same op as a backward op (replaying a saved seed) is fine
    rng(backward_graph(torch.ops.aten.native_dropout.default, (0.1, True), forward=False), _schedule())
    with pytest.raises(PorosExactnessError, match="graph-safe RNG"):
        rng(backward_graph(graphsafe_run_with_rng_state, (), forward=True), _schedule())


def test_lower_rng_calls_the_wrappers_device_implementation_with_the_same_results():
    """Each RNG wrapper becomes the plain function its device's dispatch runs (same node name), a
    wrapper on a device without one stays, and the plain functions save and replay the generator
    exactly as the higher-order ops do."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    from poros_fx.passes.lower_rng import lower_rng
    from poros_fx.runtime import rng as rng_impl

    dropout = torch.ops.aten.native_dropout.default
    g = fx.Graph()
    state, x, m = g.placeholder("state"), g.placeholder("x"), g.placeholder("m")
    x.meta["val"], m.meta["val"] = torch.empty(2), torch.empty(2, device="meta")
    save = g.call_function(run_and_save_rng_state, (dropout, x, 0.1, True))
    restore = g.call_function(run_with_rng_state, (state, dropout, x, 0.1, True))
    rand = g.call_function(run_and_save_rng_state, (torch.ops.aten.rand.default, [3]), {"device": torch.device("cpu")})
    other = g.call_function(run_with_rng_state, (state, dropout, m, 0.1, True))
    g.output((save, restore, rand, other))
    names = [n.name for n in (save, restore, rand, other)]
    gm = lower_rng(fx.GraphModule(torch.nn.Module(), g), _schedule())
    assert [n.target for n in (save, restore, rand, other)] == [
        rng_impl.run_and_save_rng_state_cpu, rng_impl.run_with_rng_state_cpu, rng_impl.run_and_save_rng_state_cpu,
        run_with_rng_state]
    assert [n.name for n in (save, restore, rand, other)] == names
    assert "higher_order.run_and_save_rng_state" not in gm.graph.python_code("self").src

    t = torch.randn(64, 32)
    torch.manual_seed(3)
    hop_state, (hop_out, hop_mask) = run_and_save_rng_state(dropout, t, 0.3, True)
    hop_replay = run_with_rng_state(hop_state, dropout, t, 0.3, True)
    hop_after = torch.rand(4)
    torch.manual_seed(3)
    state_, (out, mask) = rng_impl.run_and_save_rng_state_cpu(dropout, t, 0.3, True)
    replay = rng_impl.run_with_rng_state_cpu(state_, dropout, t, 0.3, True)
    assert torch.equal(state_, hop_state) and torch.equal(out, hop_out) and torch.equal(mask, hop_mask)
    assert torch.equal(replay[0], hop_replay[0]) and torch.equal(replay[0], out)
    assert torch.equal(torch.rand(4), hop_after)  # the generator is left where the wrappers leave it


def test_lower_rng_names_the_ops_cuda_device():
    """torch's CUDA wrappers read the *current* device's generator; lowered, a wrapper whose op runs on
    cuda:1 reads and sets cuda:1's, whatever device is current (the backward runs on autograd's thread)."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    from torch._subclasses.fake_tensor import FakeTensorMode

    from poros_fx.passes.lower_rng import lower_rng

    dropout = torch.ops.aten.native_dropout.default
    g = fx.Graph()
    state, x = g.placeholder("state"), g.placeholder("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(2, device="cuda:1")
    save = g.call_function(run_and_save_rng_state, (dropout, x, 0.1, True))
    restore = g.call_function(run_with_rng_state, (state, dropout, x, 0.1, True))
    g.output((save, restore))
    gm = lower_rng(fx.GraphModule(torch.nn.Module(), g), _schedule())
    assert [n.target.__name__ for n in (save, restore)] == ["run_and_save_rng_state_cuda1", "run_with_rng_state_cuda1"]
    assert "run_with_rng_state_cuda1(state, " in gm.graph.python_code("self").src
