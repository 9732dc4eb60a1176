"""The batch stream of batched inference (gt_fused3s.drivers.stream): on a CPU
prefetch stages inline, and the stream yields what the plain path gives."""
import pytest
import torch

from gt_fused3s.drivers.stream import _tensors, num_graphs, pin, stage, stream_batches
from gt_fused3s.data import molecules_dataset
from gt_fused3s.models import GraphTransformer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setting():
    ds = molecules_dataset(num_graphs=10, batch_size=4, num_features=6, seed=2)
    torch.manual_seed(0)
    model = GraphTransformer(6, 16, 3, num_layers=2, heads=2, backend="fused3s",
                             readout="graph").eval()
    return ds, [pin(ds.get(i, "cpu")) for i in range(len(ds))], model


@pytest.mark.parametrize("prefetch", [True, False])
def test_stream_yields_the_plain_batches(setting, prefetch, stand_in_kernels):
    ds, batches, model = setting
    order = [2, 0, 1, 2, 0]                         # r % B order of a timed run, wrapping
    staged = list(stream_batches(batches, model, CPU, order, prefetch=prefetch))
    assert len(staged) == len(order)
    for i, st in zip(order, staged):
        plain = ds[i]
        for key in ("x", "edge_index", "batch", "ptr"):
            assert torch.equal(st.data[key], plain[key])
        assert num_graphs(st.data) == plain.ptr.numel() - 1
        graph = model.prepare_graph(model.make_graph(plain.edge_index, plain.num_nodes))
        assert torch.equal(st.graph.plan.bsb.cols, graph.plan.bsb.cols)
        assert torch.equal(st.graph.plan.bsb.bitmap, graph.plan.bsb.bitmap)
        with torch.inference_mode():
            got = model(st.data.x, None, st.data.batch, graph=st.graph,
                        num_graphs=num_graphs(st.data))
            want = model(plain.x, plain.edge_index, plain.batch)
        assert torch.equal(got, want)
    assert [num_graphs(s.data) for s in stream_batches(batches, model, CPU)] == [4, 4, 2]


def test_staged_tensors_are_all_found(setting, stand_in_kernels):
    """Prefetch record_streams every tensor of a staged batch on the main
    stream: the data's and every format's (the plan's BSB arrays and schedules)."""
    _, batches, model = setting
    model.backend = "reference"
    st = stage(batches[0], model, CPU)
    st.graph.prepare("fused3s", 2, 8, backward=True)
    found = {t.data_ptr() for t in _tensors(st)}
    plan = st.graph.plan
    bsb = plan.bsb
    for t in (st.data.x, st.data.edge_index, st.data.batch, st.data.ptr, bsb.rw_offset,
              bsb.cols, bsb.bitmap, bsb.window_order, bsb.edge_index, st.graph.edge_index,
              *plan.forward_args(2, 16), *plan.backward_args(2, 16)):   # head dim 8 runs padded to 16
        assert t.data_ptr() in found
    model.backend = "fused3s"
