"""graphs.py's edge rewrite against a fake CUDA driver (the GPU tests run it on a real graph)."""
import ctypes
import sys
import types

import pytest

from cupy_xattn import graphs


class FakeDriver:
    """A graph of kernel nodes (name, virtual architecture) and other nodes (None), and its edges;
    ``edge_data``: (from_port, type) of the edges that are not plain ones (0, 0)."""

    def __init__(self, nodes, edges, missing=(), fail=(), edge_data=None):
        self.nodes, self.edges, self.missing, self.fail = nodes, list(edges), set(missing), set(fail)
        self.edge_data = edge_data or {}
        self.programmatic = []

    def __call__(self, function, *args):
        if function in self.missing:
            raise graphs.GraphError(f"the CUDA driver has no {function}")
        if function in self.fail:
            raise graphs.GraphError(f"{function} failed (CUresult 1)")
        getattr(self, function)(*args)

    @staticmethod
    def _out(by_reference):  # what ctypes.byref(x) points at
        return by_reference._obj

    def cuGraphGetEdges_v2(self, graph, sources, targets, data, count):
        if sources is not None:
            for i, (a, b) in enumerate(self.edges):
                sources[i], targets[i] = a, b
                data[i].from_port, data[i].type = self.edge_data.get((a, b), (0, 0))
        self._out(count).value = len(self.edges)

    def cuGraphNodeGetType(self, node, node_type):
        self._out(node_type).value = 0 if self.nodes[node.value] is not None else 1

    def cuGraphKernelNodeGetParams_v2(self, node, params):
        if self.nodes[node.value] == "CUkernel":
            self._out(params).kern = node.value
        else:
            self._out(params).func = node.value  # the node's id stands for its function

    def cuFuncGetName(self, name, func):
        self._out(name).value = self.nodes[func.value][0].encode()

    def cuFuncGetAttribute(self, value, attribute, func):
        assert attribute.value == 5  # CU_FUNC_ATTRIBUTE_PTX_VERSION
        self._out(value).value = self.nodes[func.value][1]

    def cuGraphRemoveDependencies_v2(self, graph, sources, targets, data, count):
        assert data is None and count.value == 1
        self.edges.remove((sources[0], targets[0]))

    def cuGraphAddDependencies_v2(self, graph, sources, targets, data, count):
        edge = self._out(data)
        assert (edge.from_port, edge.to_port, edge.type, count.value) == (1, 0, 1, 1)
        self.programmatic.append((sources[0], targets[0]))


# Node ids from 1: cuBLAS GEMMs (8 launched as a CUkernel), the library's kernels (7 built below
# sm_90), an event node.
NODES = {1: ("nvjet_gemm", 90), 2: ("half_copy_absmax", 90), 3: ("half_rescale", 90), 4: ("attn_bwd", 90),
         5: None, 6: ("nvjet_gemm_2", 90), 7: ("transposed_copies", 80), 8: "CUkernel"}
EDGES = [(2, 3), (3, 1), (1, 4), (5, 4), (4, 6), (6, 7), (4, 2), (8, 3), (4, 8)]


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver(NODES, EDGES)
    monkeypatch.setattr(graphs, "_call", fake)
    return fake


def test_only_edges_from_a_kernel_into_one_of_ours_built_for_sm90_become_programmatic(driver):
    changed = graphs.make_programmatic(1234)
    # Not: into cuBLAS (3 → 1, 4 → 6, 4 → 8), from an event node (5 → 4), into a kernel built for sm_80 (6 → 7).
    assert driver.programmatic == [(2, 3), (1, 4), (4, 2), (8, 3)]
    assert changed == [("half_copy_absmax", "half_rescale"), ("nvjet_gemm", "attn_bwd"),
                       ("attn_bwd", "half_copy_absmax"), ("", "half_rescale")]
    assert sorted(driver.edges) == sorted(set(EDGES) - {(2, 3), (1, 4), (4, 2), (8, 3)})


def test_edges_that_are_not_plain_completions_stay_as_they_are(monkeypatch):
    # Already programmatic (2 → 3), or from the launch-order port (1 → 4): not an edge that waits for
    # the upstream kernel to finish, so there is nothing to relax.
    fake = FakeDriver(NODES, EDGES, edge_data={(2, 3): (1, 1), (1, 4): (2, 0)})
    monkeypatch.setattr(graphs, "_call", fake)
    assert graphs.make_programmatic(1234) == [("attn_bwd", "half_copy_absmax"), ("", "half_rescale")]
    assert fake.programmatic == [(4, 2), (8, 3)]


@pytest.fixture
def fake_cupy(monkeypatch):
    """Just enough CuPy for graphs.programmatic: a device of compute capability 9.0 and a runtime."""
    instantiated = []

    class RuntimeError_(RuntimeError):
        pass

    def instantiate(graph):
        instantiated.append(graph)
        return 99

    runtime = types.SimpleNamespace(graphInstantiate=instantiate, graphLaunch=lambda *a: None,
                                    graphExecDestroy=lambda e: None)
    device = types.SimpleNamespace(compute_capability="90")
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: device, runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    runtime_module = types.ModuleType("cupy_backends.cuda.api.runtime")
    runtime_module.CUDARuntimeError = RuntimeError_
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.api.runtime", runtime_module)
    return types.SimpleNamespace(device=device, runtime=runtime, instantiated=instantiated, error=RuntimeError_)


def test_programmatic_instantiates_the_changed_graph(fake_cupy, driver):
    captured = types.SimpleNamespace(graph=1234)
    graph = graphs.programmatic(captured)
    assert isinstance(graph, graphs.ProgrammaticGraph) and fake_cupy.instantiated == [1234]
    assert len(graph.programmatic_edges) == 4


def test_programmatic_keeps_the_captured_graph_when_no_edge_changes(fake_cupy, monkeypatch):
    # Only edges into cuBLAS, from an event node, into a kernel built for sm_80: no second instantiation.
    fake = FakeDriver(NODES, [(3, 1), (5, 4), (4, 6), (6, 7), (4, 8)])
    monkeypatch.setattr(graphs, "_call", fake)
    captured = types.SimpleNamespace(graph=1234)
    assert graphs.programmatic(captured) is captured and fake_cupy.instantiated == []


@pytest.mark.parametrize("failure", ["old GPU", "no driver call", "a call fails", "instantiation fails"])
def test_programmatic_keeps_the_captured_graph_when_it_cannot_change_it(fake_cupy, monkeypatch, failure):
    fake = FakeDriver(NODES, EDGES, missing={"cuFuncGetName"} if failure == "no driver call" else (),
                      fail={"cuGraphAddDependencies_v2"} if failure == "a call fails" else ())
    monkeypatch.setattr(graphs, "_call", fake)
    if failure == "old GPU":
        fake_cupy.device.compute_capability = "80"
    if failure == "instantiation fails":
        def refuse(graph):
            raise fake_cupy.error("cudaErrorInvalidValue")
        fake_cupy.runtime.graphInstantiate = refuse
    captured = types.SimpleNamespace(graph=1234)
    if failure == "old GPU":
        assert graphs.programmatic(captured) is captured and fake.programmatic == []
    else:
        with pytest.warns(RuntimeWarning, match="ordinary edges"):
            assert graphs.programmatic(captured) is captured


def test_a_missing_driver_call_is_a_graph_error(monkeypatch):
    monkeypatch.setattr(graphs, "_driver", lambda: types.SimpleNamespace())
    with pytest.raises(graphs.GraphError, match="cuGraphGetEdges_v2"):
        graphs._call("cuGraphGetEdges_v2")


def test_the_edge_data_and_kernel_parameters_have_the_drivers_layout():
    assert ctypes.sizeof(graphs._EdgeData) == 8
    assert bytes(graphs._EdgeData(from_port=1, type=1)) == b"\x01\x00\x01\x00\x00\x00\x00\x00"
    params = graphs._KernelNodeParams
    assert (ctypes.sizeof(params), params.params.offset, params.kern.offset, params.ctx.offset) == (72, 40, 56, 64)
