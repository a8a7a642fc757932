from __future__ import annotations

from tests.converger_kit import GPU, Node, hold, spec


async def test_bind_then_nothing_to_do_then_release(tmp_path):
    node = Node(tmp_path)
    s1 = spec(1, hold("a1", GPU[0], cpus="0-3", memory_bytes=4 << 30), hold("a2", f"{GPU[6]}/gi1/ci0"), hold("a3", f"{GPU[4]}/slot0", f"{GPU[4]}/slot1"))
    p, r = await node.converge(s1)
    assert not r.errors, r.errors
    assert p.kinds() == ["BindHold", "BindHold", "BindHold"], p.kinds()
    assert set(node.holds()) == {"a1", "a2", "a3"}
    assert node.slice_names() == ["a1"]
    assert node.env("a1").splitlines()[:2] == ["BCD_ALLOCATION_ID=a1", "BCD_CGROUP_PARENT=bcd-alloc-a1.slice"]
    assert len(node.outbox.of_type("bound")) == 3
    assert node.outbox.of_type("section")[-1]["state"] == "CONVERGED"
    again = node.plan(s1)
    assert again.steps == (), again.kinds()

    s2 = spec(2, hold("a2", f"{GPU[6]}/gi1/ci0"), hold("b1", GPU[0]))
    p, r = await node.converge(s2)
    assert not r.errors, r.errors
    assert p.kinds() == ["ReleaseHold", "ReleaseHold", "BindHold"], p.kinds()
    assert set(node.holds()) == {"a2", "b1"}
    assert node.slice_names() == []
    rel = node.outbox.reports("released", node.signer)
    assert {b.event.allocation_id for b in rel} == {"a1", "a3"}
    assert node.plan(s2).steps == ()
