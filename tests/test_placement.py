"""Which writer a runner uses on which node, and which node holds which file: pure functions, no Ray."""

from __future__ import annotations

from rllib_recorder.config import RecorderConfig
from rllib_recorder.format import layout
from rllib_recorder.format.manifest import place_files
from rllib_recorder.record.binding import Binding, assign_writer


def binding(node_tags):
    return Binding(run_id="r", run_dir="/x", namespace="n", num_writers=2, config=RecorderConfig(),
                   node_tags=node_tags)


def test_a_runner_spools_under_its_own_nodes_file_name_for_a_writer_there():
    b = binding({"driver": "", "a": layout.node_tag(1)})
    assert b.stem_for("driver", 1, False) == "worker-001"
    assert b.stem_for("a", 3, True) == "eval-worker-003.node1"
    assert b.stem_for("unknown", 1, False) is None  # no writer there yet: the runner holds its samples
    assert [assign_writer(k, False, 2) for k in (1, 2, 3)] == [0, 1, 0]
    assert assign_writer(1, True, 2) == 1  # evaluation: half-way round


def test_file_names_carry_their_node_and_place_back_onto_it():
    names = [layout.file_name(1), layout.file_name(1, tag=layout.node_tag(2)),
             layout.file_name(3, True, layout.node_tag(1)), "worker-004.node7.h5"]
    assert names[:3] == ["worker-001.h5", "worker-001.node2.h5", "eval-worker-003.node1.h5"]
    assert [layout.file_tag_of(n) for n in names] == ["", "node2", "node1", "node7"]
    nodes = {str(i): {"node_id": f"id{i}", "node_ip": "10.0.0.1", "hostname": f"h{i}"} for i in range(3)}
    placed = place_files(names, nodes)
    assert placed["worker-001.h5"] == {**nodes["0"], "node_index": 0}
    assert placed["worker-001.node2.h5"]["node_id"] == "id2" and placed["eval-worker-003.node1.h5"]["hostname"] == "h1"
    assert placed["worker-004.node7.h5"] == {}  # a node the manifest does not know: left unplaced
