"""Hardware specs: every shipped file loads; bad files get one-line errors."""

from __future__ import annotations

import pytest

from moeflow.core.errors import UserError
from moeflow.core.hardware import list_hardware, load_hardware


def test_required_specs_ship_and_load():
    names = set(list_hardware())
    assert {"a100-80g-x8", "h100-80g-x8", "h200-141g-x8", "supernode-384", "cpu-local"} <= names
    for name in names:
        hw = load_hardware(name)
        assert hw.world_size == hw.devices_per_node * hw.nodes
        assert hw.memory_bytes > 0 and hw.peak_flops() > 0


def test_supernode_domain_spans_nodes_and_links_are_picked_by_span():
    sn = load_hardware("supernode-384")
    assert sn.hbd_size >= 100 and sn.hbd_size > sn.devices_per_node
    assert sn.link_bandwidth(64) == sn.inter_node_bandwidth_gbs * 1e9  # across servers, same fabric
    assert sn.link_bandwidth(768) == sn.inter_hbd_bandwidth_gbs * 1e9
    h100 = load_hardware("cluster/hardware/h100-80g-x8.yaml", nodes=4)
    assert h100.world_size == 32 and h100.hbd_size == 8
    assert h100.link_bandwidth(8) > h100.link_bandwidth(16)
    assert h100.peak_flops("fp8") == 1979e12 and h100.peak_flops("bf16") == 989e12
    assert load_hardware("a100-80g-x8").peak_flops("fp8") == load_hardware("a100-80g-x8").peak_flops("bf16")


def test_cpu_local_is_this_machine():
    hw = load_hardware("cpu-local")
    assert (hw.devices_per_node, hw.nodes) == (2, 1)
    assert hw.memory_per_device_gb * 2 <= 24 * 1.074  # 24 GiB in decimal GB


def test_bad_specs(tmp_path):
    with pytest.raises(UserError, match="unknown hardware 'h900'.*h100-80g-x8"):
        load_hardware("h900")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndevices_per_node: 8\nmemory_per_device_gb: 80\nhbm_bandwidth_gbs: 1\n"
                   "bf16_tflops: 1\nintra_node_bandwidth_gbs: 1\ninter_node_bandwidth_gbs: 1\n"
                   "memory_per_devce_gb: 3\n")
    with pytest.raises(UserError, match="memory_per_devce_gb"):
        load_hardware(str(bad))
    bad.write_text("name: [unclosed\n")
    with pytest.raises(UserError, match="invalid YAML"):
        load_hardware(str(bad))
    with pytest.raises(UserError, match="not found"):
        load_hardware(str(tmp_path / "missing.yaml"))
