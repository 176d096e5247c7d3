"""The node wire models (schema/node.py) forbid unknown fields, so a field added since leaves the wire when it
carries nothing: an agent or control plane from before it keeps reading what the other side sends."""

from __future__ import annotations

from pilldrops.schema.node import NodeRegister, NodeTemplateRef

LAYER = {"digest": "sha256:" + "0" * 64, "size": 1}


def test_a_store_templates_ref_without_defaults_leaves_them_off_the_wire() -> None:
    ref = NodeTemplateRef(name="tiny", version=1, key="k", layers=[LAYER])
    wire = ref.model_dump(mode="json")
    assert "disk_mb" not in wire and "network" not in wire
    with_defaults = NodeTemplateRef(name="tiny", version=1, key="k", layers=[LAYER], disk_mb=512,
                                    network={"allow_internet_access": True})
    assert with_defaults.model_dump(mode="json")["disk_mb"] == 512
    assert NodeTemplateRef.model_validate(with_defaults.model_dump(mode="json")) == with_defaults


def test_an_agent_that_does_not_know_its_ram_registers_as_before() -> None:
    reg = NodeRegister(name="n", url="http://n", capacity_vcpu=2, capacity_memory_mb=1024)
    assert "ram_mb" not in reg.model_dump(mode="json")
    assert NodeRegister(name="n", url="http://n", capacity_vcpu=2, capacity_memory_mb=1024,
                        ram_mb=2048).model_dump(mode="json")["ram_mb"] == 2048
